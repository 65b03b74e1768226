"""calculator: solved by its own demonstrations, failed by wrong answers, safe, deterministic."""

from __future__ import annotations

from typing import Any

import pytest

from envs.arith import ExpressionError, evaluate
from envs.calculator import CalculatorArgs, CalculatorEnv, demo_replies, final_number
from slime_async.env import EnvFactory, HermesParser, ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task, ToolCall


def tasks(split: str = "train", n: int = 5, **kw: Any) -> list[Task]:
    return CalculatorEnv.tasks(CalculatorArgs(num_train=n, num_eval=n, **kw), split)  # type: ignore[arg-type]


async def run(tokenizer: Any, task: Task, replies: list[str], **kw: Any) -> Any:
    env = CalculatorEnv(CalculatorArgs(**kw))
    return await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer)


@pytest.mark.parametrize(
    "kw", [{}, {"style": "word"}, {"variant": "two_step"}, {"show_tool_schemas": True}, {"digits": 3}]
)
async def test_demonstrations_solve_every_task(tokenizer: Any, kw: dict[str, Any]) -> None:
    for split in ("train", "eval"):
        for task in tasks(split, n=4, **kw):
            traj = await run(tokenizer, task, demo_replies(task), **kw)
            assert traj.stop_reason is StopReason.DONE, traj.error
            assert traj.rewards == {"correct": 1.0} and traj.reward == 1.0
            assert traj.metrics["tool_calls"] == len(task.metadata["steps"])
            assert traj.metrics["tool_errors"] == 0


async def test_wrong_or_missing_answers_score_zero(tokenizer: Any) -> None:
    task = tasks()[0]
    for final in (f"The answer is {task.answer + 1}.", "I do not know.", ""):
        traj = await run(tokenizer, task, [*demo_replies(task)[:-1], final])
        assert traj.stop_reason is StopReason.DONE and traj.reward == 0.0


async def test_direct_answer_without_tool_still_scores(tokenizer: Any) -> None:
    task = tasks()[0]
    traj = await run(tokenizer, task, demo_replies(task, use_tool=False))
    assert traj.reward == 1.0 and traj.metrics["tool_calls"] == 0


async def test_two_step_needs_two_dependent_calls(tokenizer: Any) -> None:
    task = tasks(variant="two_step")[0]
    whole = ToolCall(name="calculate", arguments={"expression": task.metadata["expression"]})
    one_call = HermesParser().format("", [whole])
    env = CalculatorEnv(CalculatorArgs(variant="two_step"))
    traj = await run_episode(env, task, ScriptedPolicy([one_call, "The answer is 0."], tokenizer), tokenizer)
    assert traj.metrics["tool_errors"] == 1
    # The second demonstrated call holds the first call's result, which the prompt does not show.
    first, second = task.metadata["steps"]
    assert str(evaluate(first)) in second and str(evaluate(first)) not in str(task.prompt)


async def test_episode_is_short(tokenizer: Any) -> None:
    """The embedded default trains a 3.4M model on it: a whole one-step episode stays small."""
    task = tasks()[0]
    traj = await run(tokenizer, task, demo_replies(task))
    assert traj.num_tokens <= 80, traj.num_tokens


def test_tasks_are_deterministic_and_split() -> None:
    assert tasks(n=20) == tasks(n=20)
    assert tasks(n=20, seed=1) != tasks(n=20)
    train = {t.prompt for t in tasks("train", n=2000)}
    held_out = {t.prompt for t in tasks("eval", n=200)}
    assert len(train) == 2000 and len(held_out) == 200 and not train & held_out
    assert all(t.metadata["split"] == "eval" for t in tasks("eval", n=10))


def test_factory_builds_it_from_the_config_default() -> None:
    from slime_async.config.schema import EnvConfig

    cfg = EnvConfig()
    factory = EnvFactory.from_config(cfg.name, {**cfg.args, "num_eval": 3})
    assert isinstance(factory.new(), CalculatorEnv) and len(list(factory.tasks("eval"))) == 3


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "(1).__class__", "x+1", "[1]*9", "2**1000", "1/0", "9**9**9", "'a'*3", "1;2",
     "True+1", "lambda: 1", "1" * 300],
)  # fmt: skip
def test_evaluation_refuses_anything_but_bounded_arithmetic(expression: str) -> None:
    with pytest.raises(ExpressionError):
        evaluate(expression)


@pytest.mark.parametrize(("expression", "value"), [("23*45+67", 1102), ("7/2", 3.5), ("8/2", 4), ("-(3+4)*2", -14)])
def test_evaluation(expression: str, value: float) -> None:
    assert evaluate(expression) == value and type(evaluate(expression)) is type(value)


def test_final_number() -> None:
    assert final_number("The answer is 1,102.") == 1102
    assert final_number("first 3 then -7") == -7
    assert final_number("none") is None


async def test_demo_transcripts_for_warm_start(tokenizer: Any) -> None:
    from envs.calculator import demo_transcripts

    batch = tasks(n=20)
    trajs = await demo_transcripts(batch, tokenizer, tool_fraction=0.5, seed=3)
    assert [t.task_id for t in trajs] == [t.id for t in batch]
    assert all(t.reward == 1.0 for t in trajs)
    with_tool = sum(t.metrics["tool_calls"] > 0 for t in trajs)
    assert 0 < with_tool < 20  # a mix, drawn by the seed
    again = await demo_transcripts(batch, tokenizer, tool_fraction=0.5, seed=3)
    assert [t.metrics["tool_calls"] for t in again] == [t.metrics["tool_calls"] for t in trajs]
    ids, _, mask = trajs[0].flat()
    text = tokenizer.decode(ids[mask == 1])
    assert text.endswith(f"The answer is {batch[0].answer}.<|im_end|>") and "<|im_start|>" not in text


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
async def test_demo_tool_fraction_mixes_direct_answers_into_the_demonstrations(tokenizer: Any, fraction: float) -> None:
    args = CalculatorArgs(num_train=1000, demo_tool_fraction=fraction)
    batch = CalculatorEnv.tasks(args, "train")
    replies = [CalculatorEnv.demonstration(args, t) for t in batch]
    with_tool = sum(len(r) > 1 for r in replies)
    assert abs(with_tool / len(batch) - fraction) < 0.05  # a hash of the id: about binomial, sd 0.015
    assert replies == [CalculatorEnv.demonstration(args, t) for t in batch]  # the same tasks every time
    for task, script in zip(batch[:10], replies[:10], strict=True):  # every one of them still earns the reward
        traj = await run(tokenizer, task, script)
        assert traj.reward == 1.0 and traj.metrics["tool_calls"] == len(script) - 1
