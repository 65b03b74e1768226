"""The `slime-async` command: every command through typer's runner, and the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import benchmarks
from slime_async.cli.main import app
from slime_async.config import Config, load_config
from slime_async.types import Trajectory, from_json

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_help_lists_the_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("train", "rollout", "serve", "init-model", "bench", "config"):
        assert command in result.stdout


def test_config_show_prints_the_resolved_config(tmp_path: Path) -> None:
    result = invoke("config", "show", str(REPO / "configs/local.yaml"), "rollout.group_size=4")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert shown["rollout"]["group_size"] == 4
    assert shown["rollout"]["max_staleness"] == 2
    path = tmp_path / "shown.yaml"
    path.write_text(result.stdout)
    assert load_config(path) == load_config(REPO / "configs/local.yaml", ["rollout.group_size=4"])
    assert isinstance(load_config(path), Config)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["config", "show", "configs/local.yaml", "rollout.sampling.temprature=2"], "did you mean 'temperature'?"),
        (["config", "show", "no/such.yaml"], "no/such.yaml: no such config file"),
        (["train", "configs/local.yaml", "train.lr=-1"], "train.lr: got -1; expected float > 0.0"),
        (["train", "configs/local.yaml", "model.path=/no/model"], "model.path: /no/model does not exist"),
        (["serve", "--model", "/no/model"], "--model: /no/model does not exist"),
        (["serve", "--host", "0.0.0.0"], "--host 0.0.0.0 is not loopback: give --admin-token"),
        (["rollout", "configs/local.yaml", "--split", "dev"], "--split: got 'dev'; expected 'train' or 'eval'"),
        (["rollout", "configs/local.yaml", "env.name=envs.nope:X"], "env.name: cannot import module 'envs.nope'"),
        (["bench", "nope"], "unknown benchmark 'nope'; available: adaptive_concurrency, agent_endpoint, async_vs_sync"),
        (["bench", "codec", "train.loss=sapo"],
         "benchmark codec takes no config overrides (those that do: learning, learning_moe)"),
        (["bench", "learning", "--quick", "train.los=sapo"], "train.los: unknown key; did you mean 'loss'?"),
        (["init-model", "x", "--preset", "huge"], "--preset: got 'huge'; expected one of 'tiny'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(monkeypatch: pytest.MonkeyPatch, args: list[str], expected: str) -> None:
    monkeypatch.chdir(REPO)
    result = invoke(*args)
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert message.startswith("error: ") and expected in message
    assert "Traceback" not in result.output


def test_train_refuses_to_overwrite_a_run(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "metrics.jsonl").write_text("{}\n")
    result = invoke("train", "configs/local.yaml", f"run.dir={tmp_path}")
    assert result.exit_code == 2
    assert "already holds a run; pass --resume to continue it, --overwrite to start over" in " ".join(
        result.stderr.split())
    assert (tmp_path / "local" / "metrics.jsonl").read_text() == "{}\n"  # nothing lost


def test_a_warm_start_misconfigured_is_one_line(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
                                                tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)
    for override, expected in [
        ("warmstart.examples=64", "warmstart.examples and warmstart.stages: give one"),  # local.yaml has stages
        ("warmstart.stages=[{examples: 64, env_args: {demo_tool_fractio: 1}}]",
         "warmstart.stages[0].env_args: env.args: Object contains unknown field `demo_tool_fractio`"),
    ]:
        result = invoke("train", "configs/local.yaml", f"run.dir={tmp_path}", "--overwrite", override)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert expected in " ".join(result.stderr.split())


def test_rollout_writes_trajectories(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The rollout side alone: an embedded engine process, the calculator env, a JSONL file."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "t.jsonl"
    result = invoke("rollout", "configs/local.yaml", "--groups", "2", "--out", str(out), "rollout.group_size=3",
                    "rollout.sampling.max_new_tokens=8", "train.distill.model=tiny")
    assert result.exit_code == 0, result.output
    lines = out.read_bytes().splitlines()
    said = " ".join(result.stdout.split())
    assert len(lines) == 6 and f"wrote 6 trajectories to {out}" in said
    assert "note: train.distill is a training setting: `slime-async rollout` asks no teacher" in said
    trajectories = [from_json(line, Trajectory) for line in lines]
    assert len({t.group_id for t in trajectories}) == 2
    assert all(t.env == "envs.calculator:CalculatorEnv" for t in trajectories)


@pytest.mark.parametrize("agent", ["run_anthropic", "run_responses"])
def test_rollout_runs_agents_of_the_other_apis(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path,
                                               agent: str) -> None:
    """The bundled calculator agent in Anthropic's Messages API and OpenAI's Responses API, through the
    endpoint of a rollout worker, against an embedded engine process."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "t.jsonl"
    result = invoke("rollout", "configs/calculator_agent.yaml", "--groups", "1", "--out", str(out),
                    "rollout.group_size=2", f"env.args.agent=envs.calculator_agent:{agent}")
    assert result.exit_code == 0, result.output
    trajectories = [from_json(line, Trajectory) for line in out.read_bytes().splitlines()]
    assert len(trajectories) == 2 and all(t.env == "envs.calculator_agent:CalculatorAgentEnv" for t in trajectories)
    for t in trajectories:  # every call the agent made was recorded, its reward is the agent's
        assert t.turns and all(len(turn.completion_ids) > 0 for turn in t.turns) and "agent" in t.rewards, t.error


def test_init_model_writes_and_describes(tmp_path: Path) -> None:
    out = tmp_path / "model"
    result = invoke("init-model", str(out), "--seed", "3")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() and (out / "chat_template.jinja").is_file()
    assert "Qwen2ForCausalLM" in result.stdout and "parameters" in result.stdout
    again = invoke("init-model", str(out))
    assert again.exit_code == 2 and "exists and is not empty" in again.stderr
    assert invoke("init-model", str(out), "--force").exit_code == 0


def test_bench_lists_runs_and_writes_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    listed = invoke("bench", "--list")
    assert listed.exit_code == 0 and "codec" in listed.stdout
    monkeypatch.setattr(benchmarks, "RESULTS_DIR", tmp_path)
    result = invoke("bench", "codec", "--quick")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "codec.json").read_text())
    assert record["benchmark"] == "codec" and len(record["rows"]) == 6
    assert result.stdout.strip().splitlines()[-1] == record["headline"]
    assert "(goal" in record["headline"]


def test_bench_overrides_reach_a_training_benchmark_and_keep_the_plain_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import types

    seen: list[list[str] | None] = []

    def run(quick: bool = False, overrides: list[str] | None = None) -> benchmarks.Result:
        seen.append(overrides)
        return benchmarks.Result(["x"], [[1]], "figure (goal 1)")

    fake = types.ModuleType("benchmarks.fake_training")
    fake.DESCRIPTION, fake.OVERRIDES_OF, fake.run = "a stand-in", "configs/local.yaml", run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.fake_training", fake)
    monkeypatch.setattr(benchmarks, "RESULTS_DIR", tmp_path)
    benchmarks.run_benchmark("fake_training", quick=True)
    benchmarks.run_benchmark("fake_training", quick=True, overrides=["train.loss=sapo", "run.name=a/b"])
    assert seen == [None, ["train.loss=sapo", "run.name=a/b"]]
    plain = json.loads((tmp_path / "fake_training.json").read_text())
    other = json.loads((tmp_path / "fake_training+train.loss=sapo+run.name=a_b.json").read_text())
    assert plain["overrides"] == [] and other["overrides"] == ["train.loss=sapo", "run.name=a/b"]
    with pytest.raises(ValueError, match="benchmark codec takes no config overrides"):
        benchmarks.run_benchmark("codec", quick=True, overrides=["train.loss=sapo"])


def test_real_entry_point_process() -> None:
    """The installed console script and `python -m`, as separate processes with real exit codes."""
    script = Path(sys.executable).with_name("slime-async")
    ok = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "init-model" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "slime_async.cli", "config", "show", str(REPO / "configs/local.yaml"), "x.y=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "x: unknown key" in bad.stderr


def test_rollout_reads_the_data_section(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A JSONL dataset (one bad row, skipped and counted) instead of the env's own tasks."""
    monkeypatch.chdir(REPO)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "What is 2+2?", "label": "4"}\nnot json\n{"prompt": "And 3+3?", "label": "6"}\n')
    out = tmp_path / "t.jsonl"
    result = invoke("rollout", "configs/local.yaml", "--groups", "2", "--out", str(out), "rollout.group_size=2",
                    "rollout.sampling.max_new_tokens=4", "data.source=jsonl", f"data.path={data}",
                    "env.name=envs.chat:ChatEnv", "env.args={verifier: exact}")
    assert result.exit_code == 0, result.output
    trajectories = [from_json(line, Trajectory) for line in out.read_bytes().splitlines()]
    assert len(trajectories) == 4 and {t.env for t in trajectories} == {"envs.chat:ChatEnv"}
    assert len({t.task_id for t in trajectories}) == 2
