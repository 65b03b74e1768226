"""A slime-style multi-turn generate function, run by the scheduler against a real engine process,
produces trainable trajectories: every model token keeps its logprob and the version that made it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import post as http_post

from slime_async.data import SLIME_ENV_NAME, Sample, SlimeGenerateFactory, to_turns
from slime_async.data.slime_compat import _Call, post
from slime_async.env import Sampling
from slime_async.launch.process import EngineProcess
from slime_async.rollout import ListSink, Scheduler, SGLangClient
from slime_async.types import StopReason, Task

SEEN: list[Sample] = []


async def multi_turn_generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Written the way slime's examples write them (search-r1, multi-turn tool use): the function
    calls /generate itself, appends observations with loss mask 0, and fills the Sample."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tok = args.tokenizer
    prompt_ids = tok.encode(sample.prompt, add_special_tokens=False)
    response, response_ids, loss_mask, log_probs = "", [], [], []
    for turn in range(args.max_turns):
        out = await post(
            url, {"input_ids": prompt_ids + response_ids, "sampling_params": sampling_params, "return_logprob": True}
        )
        new_ids = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        response += out["text"]
        response_ids += new_ids
        loss_mask += [1] * len(new_ids)
        log_probs += [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        sample.weight_versions.append(out["meta_info"]["weight_version"])
        if turn + 1 == args.max_turns:
            break
        observation = f"\n<obs>{turn}</obs>\n"
        obs_ids = tok.encode(observation, add_special_tokens=False)
        response += observation
        response_ids += obs_ids
        loss_mask += [0] * len(obs_ids)
        log_probs += [0.0] * len(obs_ids)
    sample.tokens = prompt_ids + response_ids
    sample.response, sample.response_length = response, len(response_ids)
    sample.loss_mask, sample.rollout_log_probs = loss_mask, log_probs
    sample.status = Sample.Status.COMPLETED
    SEEN.append(sample)
    return sample


async def length_reward(args: Any, sample: Sample) -> float:
    return float(len(sample.response) % 3)


async def failing_generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    raise RuntimeError("tool backend down")


async def test_a_multi_turn_slime_function_makes_trainable_trajectories(engine: EngineProcess, tokenizer) -> None:
    SEEN.clear()
    status, _ = await http_post(engine.url, "/update_weight_version", {"new_version": "5"})
    assert status == 200
    try:
        factory = SlimeGenerateFactory(
            multi_turn_generate, args={"tokenizer": tokenizer, "max_turns": 3}, reward=length_reward
        )
        tasks = [Task(id=f"t{i}", prompt=f"What is {i}+{i}?", answer=2 * i) for i in range(2)]
        sink = ListSink()
        async with SGLangClient([engine.url]) as client:
            scheduler = Scheduler(
                factory,
                tasks,
                client,
                tokenizer,
                sink,
                group_size=2,
                batch_size=4,
                sampling=Sampling(temperature=1.0, max_new_tokens=6),
                filter_equal_rewards=False,
            )
            stats = await scheduler.run()
    finally:
        await http_post(engine.url, "/update_weight_version", {"new_version": "0"})
    assert stats.balanced() and stats.sent == 4 and len(SEEN) == 4
    by_tokens = {tuple(s.tokens): s for s in SEEN}
    for t in (t for g in sink.groups for t in g):
        assert t.stop_reason == StopReason.DONE and t.env.startswith("slime:") and len(t.turns) == 3
        ids, logprobs, mask = t.flat()
        sample = by_tokens[tuple(int(i) for i in ids)]  # the trajectory's tokens are exactly the sample's
        n = sample.response_length
        assert mask[-n:].tolist() == sample.loss_mask and mask[:-n].sum() == 0
        assert np.allclose(logprobs[-n:], sample.rollout_log_probs)
        assert all(v == 5 for turn in t.turns for v in turn.versions)  # the engine's version, token by token
        assert all((turn.logprobs <= 0).all() and (turn.logprobs < 0).any() for turn in t.turns)  # real logprobs
        assert t.reward == float(len(sample.response) % 3) == t.rewards["reward"]
        assert "<obs>0</obs>" in tokenizer.decode(t.turns[1].prompt_ids)


async def test_a_failing_function_costs_its_group_with_a_reason(engine: EngineProcess, tokenizer) -> None:
    factory = SlimeGenerateFactory(failing_generate)
    sink = ListSink()
    async with SGLangClient([engine.url]) as client:
        scheduler = Scheduler(
            factory, [Task(id="t", prompt="hi")], client, tokenizer, sink, group_size=2, filter_equal_rewards=False
        )
        stats = await scheduler.run()
    assert sink.groups == [] and stats.dropped == {"env_error": 2} and stats.balanced()


def test_samples_whose_lengths_disagree_are_clear_errors() -> None:
    calls = [_Call([7, 8], [-0.5, -0.25], [2, 3])]
    good = Sample(tokens=[1, 2, 7, 8], response_length=2, loss_mask=[1, 1])
    (turn,) = to_turns(good, calls)
    assert turn.prompt_ids.tolist() == [1, 2] and turn.versions.tolist() == [2, 3]
    assert turn.logprobs.tolist() == [-0.5, -0.25]  # no rollout_log_probs: the recorded ones
    with pytest.raises(ValueError, match="loss_mask has 3 entries, response_length is 2"):
        to_turns(Sample(tokens=[1, 2, 7, 8], response_length=2, loss_mask=[1, 1, 1]), calls)
    with pytest.raises(ValueError, match="rollout_log_probs has 1 entries"):
        to_turns(Sample(tokens=[1, 2, 7, 8], response_length=2, rollout_log_probs=[0.0]), calls)
    with pytest.raises(ValueError, match="no loss-mask-1 token"):
        to_turns(Sample(tokens=[1, 2, 7, 8], response_length=2, loss_mask=[0, 0]), calls)
    # A token the record does not have gets the oldest recorded version: staleness is never underestimated.
    (turn,) = to_turns(Sample(tokens=[1, 9, 8], response_length=2), calls)
    assert turn.versions.tolist() == [2, 3]


def test_the_config_names_a_generate_function() -> None:
    from slime_async.config import load_config
    from slime_async.data import SLIME_ENV_NAME, build_envs

    cfg = load_config(
        None,
        [
            f"env.name={SLIME_ENV_NAME}",
            "env.args={generate: 'test_data_slime_compat:multi_turn_generate', "
            "reward: 'test_data_slime_compat.length_reward', args: {max_turns: 2}}",
        ],
    )
    factory = build_envs(cfg)
    assert isinstance(factory, SlimeGenerateFactory)
    assert factory.generate is multi_turn_generate and factory.reward_fn is length_reward
    assert factory.extra_args == {"max_turns": 2}
    with pytest.raises(ValueError, match=r"env\.args of .*SlimeGenerate.*generate"):
        build_envs(load_config(None, [f"env.name={SLIME_ENV_NAME}", "env.args={reward: x}"]))
    with pytest.raises(ValueError, match=r"env\.args\.generate: cannot load 'no_such_module:fn'") as err:
        build_envs(load_config(None, [f"env.name={SLIME_ENV_NAME}", "env.args={generate: 'no_such_module:fn'}"]))
    assert "\n" not in str(err.value)


def test_a_function_that_does_not_load_stops_the_command_before_anything_starts(tmp_path) -> None:
    import subprocess
    import sys

    (tmp_path / "rows.jsonl").write_text('{"prompt": "hi", "label": "x"}\n')
    (tmp_path / "run.yaml").write_text(
        f"env: {{name: '{SLIME_ENV_NAME}', args: {{generate: my_rollout.generate}}}}\n"
        f"data: {{source: jsonl, path: {tmp_path / 'rows.jsonl'}}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "slime_async.cli", "rollout", str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "env.args.generate: cannot load 'my_rollout.generate'" in out.stderr
    assert "Traceback" not in out.stderr and "engine" not in out.stdout


async def tau_bench_like(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """tau-bench's pattern: the interaction runs elsewhere; a new Sample is built from its result, with
    the status given by value."""
    tok = args.tokenizer
    prompt_ids = tok.encode(sample.prompt, add_special_tokens=False)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    out = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    reply = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    user = tok.encode("\nuser: thanks", add_special_tokens=False)
    result = Sample(
        index=sample.index,
        prompt=sample.prompt,
        tokens=prompt_ids + reply + user,
        response="",
        reward=args.reward_value,
        loss_mask=[1] * len(reply) + [0] * len(user),
        status="completed",
    )
    if args.response_length is None:
        result.response_length = len(reply) + len(user)
    else:
        result.response_length = args.response_length
    return result


async def test_a_function_may_return_a_new_sample(tokenizer) -> None:
    from slime_async.env import ScriptedPolicy

    def run(**args: Any):
        factory = SlimeGenerateFactory(
            tau_bench_like, args={"tokenizer": tokenizer, "reward_value": 1.0, "response_length": None, **args}
        )
        policy = ScriptedPolicy(["sure"], tokenizer, version=7)
        return factory.episode(Task(id="t", prompt="book a flight"), policy, tokenizer)

    t = await run()
    assert t.stop_reason == StopReason.DONE and t.reward == 1.0 and len(t.turns) == 1
    assert tokenizer.decode(t.turns[0].completion_ids, skip_special_tokens=True) == "sure"
    assert (t.turns[0].versions == 7).all()
    t = await run(response_length=0)  # slime's adapter said 'response_length 0 does not fit tokens (0)'
    assert t.stop_reason == StopReason.ENV_ERROR
    assert t.error.startswith("ValueError: sample.response_length is 0 but sample.tokens has")


async def returns_nothing(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> None:
    return None


async def returns_a_bad_list(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    good = Sample(tokens=[1, 2, 3], response_length=1, reward=1.0)
    return [good, Sample(tokens=[], reward=1.0)]


async def test_what_does_not_fit_is_said_exactly(tokenizer) -> None:
    from slime_async.env import ScriptedPolicy

    for fn, message in (
        (returns_nothing, "returned NoneType, not a Sample"),
        (returns_a_bad_list, "sample 1 of the 2 returned: does not fit: sample.tokens is empty"),
    ):
        t = await SlimeGenerateFactory(fn).episode(Task(id="t", prompt="x"), ScriptedPolicy([], tokenizer), tokenizer)
        assert t.stop_reason == StopReason.ENV_ERROR and message in t.error, t.error


async def rank_rm(args: Any, samples: list[Sample]) -> list[float]:
    """A --group-rm reward: sees the whole group at once."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].response)
    return [float(order.index(i)) for i in range(len(samples))]


async def test_group_rm_scores_the_whole_group(engine: EngineProcess, tokenizer) -> None:
    factory = SlimeGenerateFactory(
        multi_turn_generate, args={"tokenizer": tokenizer, "max_turns": 1}, reward=rank_rm, group_rm=True
    )
    sink = ListSink()
    async with SGLangClient([engine.url]) as client:
        scheduler = Scheduler(
            factory,
            [Task(id="t", prompt="Count:")],
            client,
            tokenizer,
            sink,
            group_size=3,
            sampling=Sampling(temperature=1.0, max_new_tokens=6),
            filter_equal_rewards=False,
        )
        await scheduler.run()
    (group,) = sink.groups
    assert sorted(t.reward for t in group) == [0.0, 1.0, 2.0]
    assert all(t.rewards["group_rm"] == t.reward for t in group) and factory._pending == {}


async def test_rm_type_scores_without_a_reward_function(tokenizer) -> None:
    from slime_async.env import ScriptedPolicy

    factory = SlimeGenerateFactory(multi_turn_generate, args={"tokenizer": tokenizer, "max_turns": 1}, rm_type="math")
    for reply, reward in (("so \\boxed{4}", 1.0), ("so \\boxed{5}", 0.0)):
        t = await factory.episode(
            Task(id="t", prompt="2+2?", answer="4"), ScriptedPolicy([reply], tokenizer), tokenizer
        )
        assert t.stop_reason == StopReason.DONE and t.reward == reward, t.error


async def test_offline_with_a_scripted_policy(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from slime_async.env import ScriptedPolicy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    factory = SlimeGenerateFactory(multi_turn_generate, args={"tokenizer": tok, "max_turns": 2})
    policy = ScriptedPolicy(["first", "second"], tok, version=4)
    t = await factory.episode(Task(id="t", prompt="hello"), policy, tok, sampling=Sampling(max_new_tokens=8))
    assert t.stop_reason == StopReason.ENV_ERROR and "no reward" in t.error  # no reward given: said so
    factory = SlimeGenerateFactory(multi_turn_generate, args={"tokenizer": tok, "max_turns": 2}, reward=length_reward)
    policy = ScriptedPolicy(["first", "second"], tok, version=4)
    t = await factory.episode(Task(id="t", prompt="hello"), policy, tok, sampling=Sampling(max_new_tokens=8))
    assert t.stop_reason == StopReason.DONE and len(t.turns) == 2
    assert [tok.decode(turn.completion_ids, skip_special_tokens=True) for turn in t.turns] == ["first", "second"]
    assert all((turn.versions == 4).all() for turn in t.turns)
