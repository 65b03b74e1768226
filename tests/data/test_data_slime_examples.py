"""slime's own examples (re-created under slime_examples/, external services stubbed) run unchanged but
for their imports: through the config against a real engine process, and offline with scripted
replies where a test needs the model to say something exact. Masks, logprobs, versions and rewards
are checked against what each example does."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import post as http_post

from slime_async.config import load_config
from slime_async.data import SLIME_ENV_NAME, build_envs
from slime_async.env import Sampling, ScriptedPolicy
from slime_async.launch.process import EngineProcess
from slime_async.rollout import ListSink, Scheduler, SGLangClient
from slime_async.types import StopReason, Task, Trajectory

EXAMPLES = Path(__file__).parent / "slime_examples"
TARGET = {"ground_truth": {"target": ["Paris"]}}


@pytest.fixture(autouse=True)
def example_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # as slime's run scripts put each example's directory on PYTHONPATH
    for sub in ("search_r1", "retool", ""):
        monkeypatch.syspath_prepend(str(EXAMPLES / sub))


def factory_from_config(**args):
    import json

    cfg = load_config(None, [f"env.name={SLIME_ENV_NAME}", f"env.args={json.dumps(args)}"])
    return build_envs(cfg)


async def run_on_engine(
    engine: EngineProcess, tokenizer, factory, tasks: list[Task], group_size: int = 2, max_new_tokens: int = 8
) -> list[Trajectory]:
    status, _ = await http_post(engine.url, "/update_weight_version", {"new_version": "3"})
    assert status == 200
    try:
        sink = ListSink()
        async with SGLangClient([engine.url]) as client:
            scheduler = Scheduler(
                factory,
                tasks,
                client,
                tokenizer,
                sink,
                group_size=group_size,
                batch_size=64,
                sampling=Sampling(temperature=1.0, max_new_tokens=max_new_tokens),
                filter_equal_rewards=False,
            )
            stats = await scheduler.run()
    finally:
        await http_post(engine.url, "/update_weight_version", {"new_version": "0"})
    assert stats.balanced() and stats.dropped == {}, (stats.dropped, stats.stop_reasons)
    return [t for g in sink.groups for t in g]


def check_tokens(t: Trajectory, version: int) -> None:
    """Every model token trains with a real logprob and the version that made it; nothing else trains."""
    for turn in t.turns:
        assert turn.loss_mask.tolist() == [1] * len(turn.completion_ids)
        assert (turn.logprobs <= 0).all() and (turn.logprobs < 0).any()
        assert (turn.versions == version).all()
    for ids, _, mask in t.segments():
        assert mask[0] == 0 and len(ids) == len(mask)


async def test_search_r1_on_a_real_engine(engine: EngineProcess, tokenizer) -> None:
    from qa_em_format import compute_score_em

    factory = factory_from_config(
        generate="generate_with_search.generate", reward="generate_with_search.reward_func", apply_chat_template=True
    )
    tasks = [Task(id=f"q{i}", prompt=f"Question {i}: what is the capital of France?", answer=TARGET) for i in range(2)]
    trajs = await run_on_engine(engine, tokenizer, factory, tasks)
    assert len(trajs) == 4
    for t in trajs:
        check_tokens(t, version=3)
        question = tasks[int(t.task_id[1:])].prompt
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.decode(t.turns[0].prompt_ids) == templated  # --apply-chat-template, as slime's dataset
        for turn in t.turns[1:]:  # loss-mask-0 stretches are exactly the example's observations
            obs = tokenizer.decode(turn.prompt_ids)
            assert "My previous action is invalid" in obs or "<information>" in obs
        ids, _, _ = t.flat()
        assert t.reward == compute_score_em(tokenizer.decode(ids), TARGET["ground_truth"], format_score=0.2)


async def test_search_r1_searches_and_answers(tokenizer) -> None:
    import local_search_server

    factory = factory_from_config(
        generate="generate_with_search:generate", reward="generate_with_search:reward_func", apply_chat_template=True
    )
    task = Task(id="q", prompt="What is the capital of France?", answer=TARGET)
    local_search_server.QUERIES.clear()
    for answer, reward in (("Paris", 1.0), ("Lyon", 0.2)):
        policy = ScriptedPolicy(["<search>capital of France</search>", f"<answer>{answer}</answer>"], tokenizer, 2)
        t = await factory.episode(task, policy, tokenizer, sampling=Sampling(max_new_tokens=64))
        assert t.stop_reason == StopReason.DONE and len(t.turns) == 2, t.error
        assert "<information>Doc 1(Title: Paris) Paris is the capital of France." in tokenizer.decode(
            t.turns[1].prompt_ids
        )
        assert t.reward == reward and (t.turns[1].versions == 2).all()
    assert local_search_server.QUERIES == ["capital of France"] * 2


async def test_retool_on_a_real_engine(engine: EngineProcess, tokenizer) -> None:
    factory = factory_from_config(
        generate="generate_with_retool.generate",
        reward="generate_with_retool.reward_func",
        reward_key="score",
        max_context_len=1000,
    )
    trajs = await run_on_engine(engine, tokenizer, factory, [Task(id="r", prompt="What is 2+2?", answer="4")])
    for t in trajs:
        check_tokens(t, version=3)
        for turn in t.turns[1:]:
            assert "My previous action is invalid" in tokenizer.decode(turn.prompt_ids)
        assert t.reward == -1.1 == t.rewards["score"]  # wrong, no tool call: min(-0.6, -1 + (0 - 2) / 2 * 0.1)


async def test_retool_runs_code_and_keeps_to_its_context_budget(tokenizer) -> None:
    import tool_sandbox
    from generate_with_retool import format_conversation_with_tools

    factory = factory_from_config(
        generate="generate_with_retool.generate",
        reward="generate_with_retool.reward_func",
        reward_key="score",
        max_context_len=4096,
    )
    task = Task(id="r", prompt="What is 2+2?", answer="4")
    tool_sandbox.CALLS.clear()
    policy = ScriptedPolicy(["Let me compute.<code>print(2+2)</code>", "Answer: \\boxed{4}"], tokenizer)
    t = await factory.episode(task, policy, tokenizer, sampling=Sampling(max_new_tokens=64))
    assert t.stop_reason == StopReason.DONE and t.error == ""
    assert tool_sandbox.CALLS == [{"name": "code_interpreter", "code": "print(2+2)"}]
    assert tokenizer.decode(t.turns[1].prompt_ids) == "\n\n<interpreter>\n4\n</interpreter>\n\n"
    assert t.reward == 1.0 and t.rewards["acc"] == 1.0
    # A budget 5 tokens past the first reply: the interpreter output is cut to 5 tokens, the sample TRUNCATED.
    prompt_len = len(
        tokenizer(
            format_conversation_with_tools("What is 2+2?", tool_sandbox.tool_registry.get_tool_specs()),
            add_special_tokens=False,
        )["input_ids"]
    )
    reply_len = len(tokenizer.encode("Let me compute.<code>print(2+2)</code>")) + 1
    factory = factory_from_config(
        generate="generate_with_retool.generate",
        reward="generate_with_retool.reward_func",
        reward_key="score",
        max_context_len=prompt_len + reply_len + 5,
    )
    policy = ScriptedPolicy(["Let me compute.<code>print(2+2)</code>"], tokenizer)
    t = await factory.episode(task, policy, tokenizer, sampling=Sampling(max_new_tokens=64))
    assert t.stop_reason == StopReason.TRUNCATED and len(t.turns) == 1
    assert len(t.flat()[0]) == prompt_len + reply_len and t.reward == -1.05  # one tool call; cut tokens end no turn


MULTI = {
    "generate": "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents",
    "rm_type": "deepscaler",
    "max_context_len": 2048,
}


async def test_multi_agent_returns_a_list_on_a_real_engine(engine: EngineProcess, tokenizer) -> None:
    trajs = await run_on_engine(
        engine, tokenizer, factory_from_config(**MULTI), [Task(id="m", prompt="What is 2+2?", answer="4")]
    )
    for t in trajs:
        check_tokens(t, version=3)
        segments = t.segments()
        # no solver closed its thinking: the three solver samples come back, each its own sequence
        assert t.metrics["samples"] == 3 == len(segments) and t.turns[1].new_branch and t.turns[2].new_branch
        for ids, _, mask in segments:
            assert tokenizer.decode(ids[mask == 0]).startswith("Solve the problem.")
        assert t.reward == 0.0


@pytest.mark.parametrize(
    ("selector_reply", "reward"), [("ok</think>Judgment: 1 \\boxed{4}", 1.2), ("ok</think>no verdict", 6 * 0.8 / 7)]
)
async def test_multi_agent_rewards_follow_the_selector(tokenizer, selector_reply: str, reward: float) -> None:
    factory = factory_from_config(**MULTI)
    replies = ["ok</think>Judgment: 1 \\boxed{4}"] * 6 + [selector_reply]
    t = await factory.episode(
        Task(id="m", prompt="What is 2+2?", answer="4"),
        ScriptedPolicy(replies, tokenizer),
        tokenizer,
        sampling=Sampling(max_new_tokens=64),
    )
    assert t.stop_reason == StopReason.DONE and t.metrics["samples"] == 7 == len(t.segments()), t.error
    assert t.reward == pytest.approx(reward)
    prompts = [tokenizer.decode(ids[mask == 0]) for ids, _, mask in t.segments()]
    assert sum(p.startswith("Solve the problem.") for p in prompts) == 3  # solvers
    assert sum(p.endswith("Write one better solution.\n") for p in prompts) == 3  # rewriters
    assert sum(p.endswith("end with 'Judgment: N'.\n") for p in prompts) == 1  # the selector
