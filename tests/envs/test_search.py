"""search: BM25 finds the town's document; right answers score, wrong ones do not."""

from __future__ import annotations

from typing import Any

import pytest

from envs.search import SearchArgs, SearchEnv, demo_replies, exact_match, f1
from slime_async.env import ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task


def tasks(split: str = "train", **kw: Any) -> list[Task]:
    return SearchEnv.tasks(SearchArgs(**kw), split)  # type: ignore[arg-type]


async def play(tokenizer: Any, task: Task, replies: list[str], **kw: Any) -> Any:
    return await run_episode(SearchEnv(SearchArgs(**kw)), task, ScriptedPolicy(replies, tokenizer), tokenizer)


async def test_search_then_answer_solves_held_out_questions(tokenizer: Any) -> None:
    for task in tasks("eval")[:6]:
        traj = await play(tokenizer, task, demo_replies(task))
        assert traj.stop_reason is StopReason.DONE
        assert traj.reward == 1.0 and traj.metrics["exact"] == 1.0 and traj.metrics["token_f1"] == 1.0
        # The answer was in what the tool returned: the first hit is the town's own document.
        response = tokenizer.decode(traj.turns[1].prompt_ids)
        assert f"1. {task.metadata['town']}:" in response and str(task.answer) in response


async def test_wrong_answers(tokenizer: Any) -> None:
    task = tasks()[0]
    traj = await play(tokenizer, task, [demo_replies(task)[0], "The answer is Nowhere."])
    assert traj.reward == 0.0 and traj.metrics["token_f1"] == 0.0
    traj = await play(tokenizer, task, [f"The answer is {task.answer} or Nowhere."], reward_kind="f1")
    assert traj.reward == pytest.approx(0.5) and traj.metrics["exact"] == 0.0  # P 1/3, R 1


async def test_bad_k_is_a_schema_error(tokenizer: Any) -> None:
    task = tasks()[0]
    bad = '<tool_call>{"name": "search", "arguments": {"query": "x", "k": 50}}</tool_call>'
    traj = await play(tokenizer, task, [bad, f"The answer is {task.answer}."])
    assert traj.metrics["bad_tool_args"] == 1 and traj.reward == 1.0


def test_search_tool_directly() -> None:
    env = SearchEnv()
    assert env.search("zzzz qqqq") == "no results"
    assert len(env.search("town region river", k=5).splitlines()) == 5


def test_tasks_deterministic_and_split() -> None:
    assert tasks() == tasks()
    train, held_out = {t.prompt for t in tasks()}, {t.prompt for t in tasks("eval")}
    assert held_out and not train & held_out and len(train) + len(held_out) == 3 * 200
    assert tasks(seed=1) != tasks()


def test_scoring() -> None:
    assert exact_match("The answer is: the Elber.", "Elber") == 1.0
    assert exact_match("Elber", "elber") == 1.0
    assert f1("The answer is upper Elber", "Elber") == pytest.approx(2 / 3)
