"""The guard's two rules and the error book, on trajectories of real episodes (ScriptedPolicy through
the real chat template): failures counted per name with their first message, a run that mostly fails
or carries no learning signal found once, with the reason and the first error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from slime_async.config.schema import GuardConfig
from slime_async.env import Env, ScriptedPolicy, ToolError, reward, run_episode, tool
from slime_async.rollout.errors import ErrorBook, describe, merge
from slime_async.rollout.guard import Guard
from slime_async.types import StopReason, Task, Trajectory

TASK = Task(id="t", prompt="What is 2+3?", answer=5)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Broken(Env):
    @tool
    def add(self, a: int, b: int) -> int:
        """Add."""
        raise ToolError("add is out of order")

    @reward
    def correct(self, completion: str, answer: int) -> float:
        return float(completion.strip() == str(answer))

    @reward
    def divides(self, completion: str) -> float:
        return 1 / 0


class Fine(Env):
    @reward
    def correct(self, completion: str, answer: int) -> float:
        return float(completion.strip() == str(answer))


class FailsSetup(Env):
    async def setup(self, task: Task) -> None:
        raise ConnectionError("the game server is down")


async def episodes(env: type[Env], replies: list[list[str]], tokenizer: Any) -> list[Trajectory]:
    return [
        await run_episode(env(), TASK, ScriptedPolicy(r, tokenizer), tokenizer, sample_index=i)
        for i, r in enumerate(replies)
    ]


async def test_failures_are_counted_per_name_with_their_first_message(tokenizer: Any) -> None:
    group = await episodes(Broken, [[CALL, CALL, "5"], ["5"]], tokenizer)
    setup = await episodes(FailsSetup, [["5"]], tokenizer)
    book = ErrorBook()
    for t in group + setup:
        book.add(t)
    assert book.counts == {"tool add": 2, "reward divides": 2, "env_error": 1}
    assert book.first["tool add"] == "add is out of order"
    assert book.first["reward divides"] == "ZeroDivisionError: division by zero"
    assert book.first["env_error"] == "setup failed: ConnectionError: the game server is down"
    assert group[1].rewards == {"correct": 1.0, "divides": 0.0}  # on_error, and the episode went on
    both = merge([book.summary(), book.summary()])
    assert both["counts"]["reward divides"] == 4
    assert "reward divides: 4 (first: ZeroDivisionError: division by zero)" in describe(both)


async def test_most_episodes_failing_trips_once_with_the_first_error(tokenizer: Any) -> None:
    guard = Guard(GuardConfig(window=4, max_failed_fraction=0.5), groups_per_step=1)
    fine = await episodes(Fine, [["5"], ["4"]], tokenizer)
    broken = await episodes(Broken, [["5"], ["5"]], tokenizer)
    assert guard.observe(fine, trainable=True) is None
    assert guard.observe(broken, trainable=True) is None  # 2 of 4 failed: not more than half
    verdict = guard.observe(broken[:1], trainable=True)  # 3 of the latest 4
    assert verdict is not None and verdict.rule == "failures" and verdict.action == "stop"
    assert "3 of the latest 4 episodes failed" in verdict.reason
    assert verdict.first_error == "reward divides failed: ZeroDivisionError: division by zero"
    assert guard.observe(broken, trainable=True) is None  # said once


async def test_groups_without_signal_trip_after_the_steps_given(tokenizer: Any) -> None:
    guard = Guard(GuardConfig(no_signal_steps=2, on_no_signal="stop"), groups_per_step=2)  # 4 groups
    equal = await episodes(Fine, [["4"], ["4"]], tokenizer)
    mixed = await episodes(Fine, [["5"], ["4"]], tokenizer)
    for _ in range(3):
        assert guard.observe(equal, trainable=True) is None
    assert guard.observe(mixed, trainable=True) is None  # a group with signal starts the count again
    assert guard.observe(equal, trainable=False) is None  # a dropped (failed) group counts for nothing
    for _ in range(3):
        assert guard.observe(equal, trainable=True) is None
    verdict = guard.observe(equal, trainable=True)
    assert verdict is not None and verdict.rule == "no_signal" and verdict.action == "stop"
    assert "the latest 4 groups" in verdict.reason and "(now all 0)" in verdict.reason


async def test_off_never_trips(tokenizer: Any) -> None:
    guard = Guard(GuardConfig(window=2, on_failures="off", on_no_signal="off", no_signal_steps=1), groups_per_step=1)
    broken = await episodes(Broken, [["4"], ["4"]], tokenizer)
    assert all(t.stop_reason is StopReason.DONE for t in broken)
    assert [guard.observe(broken, trainable=True) for _ in range(5)] == [None] * 5
