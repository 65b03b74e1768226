"""The supervised warm-start: token-exact demonstrations, training that lowers their loss, the cache."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from slime_async.config import load_config
from slime_async.env import EnvFactory
from slime_async.train.batch import build_batch
from slime_async.train.torch_backend import TorchBackend
from slime_async.train.warmstart import WarmstartError, demonstrations, warm_start, warmstart_dir

REPO = Path(__file__).resolve().parents[2]
SMALL = ["warmstart.enabled=true", "warmstart.stages=[]", "warmstart.examples=64", "warmstart.batch_size=16",
         "warmstart.lr=3e-3"]


def config(*overrides: str):  # -> Config
    return load_config(REPO / "configs/local.yaml", [*SMALL, *overrides])


def demo_nll(model_dir: Path, tokenizer_dir: Path) -> float:
    """Mean NLL of the trained tokens of 32 demonstrations under the model in `model_dir`."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {})
    demos = asyncio.run(demonstrations(factory, tokenizer, 32, seed=123))
    batch = build_batch(demos, 4096).batch
    assert batch is not None
    logp = TorchBackend(model_dir, device="cpu").logprobs(batch, 1.0).logprobs
    return float(-(logp * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_demonstrations_are_rewarded_episodes_that_train_only_the_model_replies(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {"variant": "two_step"})
    demos = asyncio.run(demonstrations(factory, tokenizer, 5, seed=0))
    assert [d.reward for d in demos] == [1.0] * 5
    for demo in demos:
        assert len(demo.turns) == 3  # two dependent tool calls, then the answer
        ids, _, mask = demo.flat()
        trained = tokenizer.decode(ids[mask > 0])
        assert "calculate" in trained and "The answer is" in trained
        assert "<tool_response>" not in trained and "What is" not in trained  # tool results and prompt never train


def test_an_env_without_demonstrations_or_tasks_is_named(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    factory = EnvFactory.from_config("envs.python_code:PythonCodeEnv", {})
    with pytest.raises(WarmstartError, match=r"warmstart.enabled: env envs.python_code:PythonCodeEnv has no demo"):
        asyncio.run(demonstrations(factory, tokenizer, 1, seed=0))
    factory = EnvFactory.from_config("envs.chat:ChatEnv", {})
    with pytest.raises(WarmstartError, match=r"envs.chat:ChatEnv does not generate its own tasks"):
        asyncio.run(demonstrations(factory, tokenizer, 1, seed=0))


def test_guess_number_demonstrations_search_within_the_feedback_bounds(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    factory = EnvFactory.from_config("envs.guess_number:GuessNumberEnv", {"high": 64})
    demos = asyncio.run(demonstrations(factory, tokenizer, 20, seed=0))
    assert all(d.reward > 0 for d in demos)  # every one finds the number
    guesses = [d.metrics["num_guesses"] for d in demos]
    assert max(guesses) > 7  # random, not binary search (which needs at most 7 for 1..64)
    assert sum(d.metrics["midpoint_share"] == 1.0 for d in demos) < 5
    # with demo_bisection every demonstration bisects, as played through the env
    factory = EnvFactory.from_config("envs.guess_number:GuessNumberEnv", {"high": 64, "demo_bisection": 1.0})
    demos = asyncio.run(demonstrations(factory, tokenizer, 20, seed=0))
    assert all(d.metrics["midpoint_share"] == 1.0 and d.metrics["num_guesses"] <= 7 for d in demos)


def test_warm_start_lowers_the_demonstrations_loss_and_is_cached(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = config()
    progress: list[tuple[int, int]] = []
    out, cached = warm_start(cfg, tiny_model_dir, tmp_path, lambda s, n, loss: progress.append((s, n)))
    assert not cached and progress[-1] == (4, 4) and (out / "warmstart.json").is_file()
    assert (out / "chat_template.jinja").read_bytes() == (tiny_model_dir / "chat_template.jinja").read_bytes()
    assert demo_nll(out, tiny_model_dir) < demo_nll(tiny_model_dir, tiny_model_dir) - 0.5
    again, cached = warm_start(cfg, tiny_model_dir, tmp_path)
    assert cached and again == out
    # what shapes the weights changes the key; the success check does not
    assert warmstart_dir(config("warmstart.lr=1e-3"), tiny_model_dir, tmp_path) != out
    assert warmstart_dir(config("warmstart.min_success=0.3"), tiny_model_dir, tmp_path) == out


def test_warm_start_is_deterministic_for_a_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = config("warmstart.examples=32")
    a, _ = warm_start(cfg, tiny_model_dir, tmp_path / "a")
    b, _ = warm_start(cfg, tiny_model_dir, tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c, _ = warm_start(config("warmstart.examples=32", "warmstart.seed=1"), tiny_model_dir, tmp_path / "c")
    assert not torch.equal(TorchBackend(a, device="cpu").model.lm_head.weight,
                           TorchBackend(c, device="cpu").model.lm_head.weight)


def test_lr_factor_ramps_then_decays_to_a_tenth() -> None:
    from slime_async.train.warmstart import lr_factor

    assert [lr_factor(s, 100, 4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(100, 100, 4) == pytest.approx(0.1) and 0.1 < lr_factor(50, 100, 4) < 1.0


def test_success_floor_stops_below_and_passes_at_or_above() -> None:
    from slime_async.launch.success_check import Success, SuccessTooLow, check_success

    cfg = config("warmstart.min_success=0.2")
    with pytest.raises(SuccessTooLow, match=r"warmstart\.min_success"):
        check_success(cfg, Success(sampled=0.1, greedy=0.5, tasks=8))
    check_success(cfg, Success(sampled=0.2, greedy=0.5, tasks=8))


def test_an_edited_env_source_is_another_warm_start(tiny_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "my_calc_env.py"
    module.write_text("from envs.calculator import CalculatorEnv\n\n\nclass MyEnv(CalculatorEnv):\n    pass\n")
    cfg = config("env.name=my_calc_env:MyEnv")
    before = warmstart_dir(cfg, tiny_model_dir, tmp_path)
    assert warmstart_dir(cfg, tiny_model_dir, tmp_path) == before
    module.write_text(module.read_text() + "    # demonstrations changed\n")
    assert warmstart_dir(cfg, tiny_model_dir, tmp_path) != before


def test_stages_train_in_order_each_on_its_own_demonstrations(tiny_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    from slime_async.config.schema import WarmstartStage

    base = config()
    stages = [WarmstartStage(examples=32, env_args={"demo_tool_fraction": 1.0}),
              WarmstartStage(examples=16, env_args={"demo_tool_fraction": 0.0})]
    ws = msgspec.structs.replace(base.warmstart, stages=stages, examples=None)
    cfg = msgspec.structs.replace(base, warmstart=ws)
    tool_call = AutoTokenizer.from_pretrained(str(tiny_model_dir)).convert_tokens_to_ids("<tool_call>")
    calls_tool: list[bool] = []
    real_step = TorchBackend.train_step

    def recording(self: TorchBackend, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        trained = batch.input_ids[batch.loss_mask.bool()]
        calls_tool.append(bool((trained == tool_call).any()))
        if calls_tool[-1]:  # every row of a tool stage's step calls the tool
            assert all(bool((row[m.bool()] == tool_call).any())
                       for row, m in zip(batch.input_ids, batch.loss_mask, strict=True))
        return real_step(self, batch, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "train_step", recording)
    progress: list[tuple[int, int]] = []
    out, _ = warm_start(cfg, tiny_model_dir, tmp_path, lambda s, n, loss: progress.append((s, n)))
    assert calls_tool == [True, True, False]  # 32 then 16 demonstrations in batches of 16, in order
    assert progress[-1] == (3, 3)
    assert '"demonstrations": 48' in (out / "warmstart.json").read_text()
    assert warmstart_dir(base, tiny_model_dir, tmp_path) != out  # the stages are part of the cache key


def test_bad_stages_are_named() -> None:
    import msgspec

    from slime_async.config.schema import WarmstartStage
    from slime_async.train.warmstart import check_settings, train_sft

    ws = msgspec.structs.replace(config().warmstart, examples=None)
    with pytest.raises(WarmstartError, match=r"warmstart\.examples and warmstart\.stages: give one"):
        check_settings(msgspec.structs.replace(ws, examples=64, stages=[WarmstartStage(examples=64)]))
    with pytest.raises(WarmstartError, match=r"warmstart\.stages\[1\]\.examples: 8 is fewer"):
        check_settings(msgspec.structs.replace(ws, stages=[WarmstartStage(examples=64), WarmstartStage(examples=8)]))
    bad = msgspec.structs.replace(ws, stages=[WarmstartStage(examples=16, env_args={"demo_tool_fractio": 1.0})])
    cfg = msgspec.structs.replace(config(), warmstart=bad)
    with pytest.raises(WarmstartError, match=r"warmstart\.stages\[0\]\.env_args: .*demo_tool_fractio"):
        train_sft(cfg, REPO / "nowhere", REPO / "nowhere-out")


def test_the_warm_start_writes_progress_lines_into_a_log(tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from slime_async.launch import train_run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its own cache: trained here, not found
    given_back = []
    monkeypatch.setattr(train_run, "give_back_device_memory", lambda: given_back.append(True))
    log = io.StringIO()  # not a terminal: a progress bar would draw nothing there
    _, info = train_run._warm_start(config(f"model.path={tiny_model_dir}"), Console(file=log, width=200))
    lines = [line for line in log.getvalue().splitlines() if line.strip()]
    assert info is not None and not info["cached"] and info["steps"] == 4
    assert given_back == [True]  # the launcher keeps none of the warm-start's device memory for the run
    assert [line.split(",")[0] for line in lines[:-1]] == [f"warm-start step {i}/4" for i in range(1, 5)]
    assert lines[-1].startswith("warm-start: trained")


@pytest.mark.parametrize("initialized", [True, False])
def test_the_launcher_gives_back_the_device_cache(monkeypatch: pytest.MonkeyPatch, initialized: bool) -> None:
    """After the warm-start (trained in the launcher's process), PyTorch's cached device memory goes back
    to the device, where CUDA was used at all."""
    from slime_async.launch.train_run import give_back_device_memory

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    give_back_device_memory()
    assert emptied == ([True] if initialized else [])
