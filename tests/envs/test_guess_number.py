"""guess_number: binary search wins within 11 guesses; wrong or invalid guesses do not."""

from __future__ import annotations

from typing import Any

from envs.guess_number import GuessArgs, GuessNumberEnv, binary_search_replies
from slime_async.env import Limits, ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task


def task(target: int) -> Task:
    return Task(id=f"t{target}", prompt=GuessNumberEnv.question(1024), answer=target)


async def play(tokenizer: Any, target: int, replies: list[str]) -> Any:
    return await run_episode(GuessNumberEnv(), task(target), ScriptedPolicy(replies, tokenizer), tokenizer)


async def test_binary_search_wins(tokenizer: Any) -> None:
    for target in (1, 512, 700, 1024, 3):
        replies = binary_search_replies(target)
        assert len(replies) <= 11
        traj = await play(tokenizer, target, replies)
        assert traj.stop_reason is StopReason.DONE
        assert traj.reward == 2.0 - len(replies) / 10
        assert traj.metrics["num_guesses"] == len(replies)
    traj = await play(tokenizer, 512, ["512"])
    assert traj.reward == 1.9


async def test_feedback_is_higher_or_lower(tokenizer: Any) -> None:
    traj = await play(tokenizer, 700, ["512", "800", "I guess 700"])
    assert [tokenizer.decode(t.prompt_ids).count(w) for t in traj.turns[1:] for w in ("Higher.", "Lower.")] == [
        1,
        0,
        0,
        1,
    ]
    assert traj.reward == 2.0 - 0.3


async def test_losing_and_invalid_replies(tokenizer: Any) -> None:
    traj = await play(tokenizer, 700, ["1", "2", "3"])  # the script runs out: the "server" fails
    assert traj.stop_reason is StopReason.SERVER_ERROR and traj.reward == 0.0
    env = GuessNumberEnv(GuessArgs(limits=Limits(max_turns=3)))
    traj = await run_episode(env, task(700), ScriptedPolicy(["no idea", "1", "2"], tokenizer), tokenizer)
    assert traj.stop_reason is StopReason.MAX_TURNS and traj.reward == 0.0
    assert traj.metrics["invalid_replies"] == 1 and traj.metrics["num_guesses"] == 2


def test_tasks_are_deterministic_and_split() -> None:
    args = GuessArgs(num_train=300, num_eval=50)
    train, held_out = GuessNumberEnv.tasks(args, "train"), GuessNumberEnv.tasks(args, "eval")
    assert train == GuessNumberEnv.tasks(args, "train")
    assert not {t.answer for t in train} & {t.answer for t in held_out}
    assert all(1 <= t.answer <= 1024 for t in train + held_out)
    assert len({t.id for t in train}) == 300
