"""guess_number: binary search wins within 11 guesses; wrong or invalid guesses do not."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from envs.guess_number import GuessArgs, GuessNumberEnv, binary_search_replies, random_search_replies
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
        assert traj.metrics["num_guesses"] == len(replies) and traj.metrics["found"] == 1.0
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
    assert traj.metrics["found"] == 0.0


def test_tasks_are_deterministic_and_split() -> None:
    args = GuessArgs(num_train=300, num_eval=50)
    train, held_out = GuessNumberEnv.tasks(args, "train"), GuessNumberEnv.tasks(args, "eval")
    assert train == GuessNumberEnv.tasks(args, "train")
    assert not {t.answer for t in train} & {t.answer for t in held_out}
    assert all(1 <= t.answer <= 1024 for t in train + held_out)
    assert len({t.id for t in train}) == 300


def test_random_search_is_capped_to_win_within_the_turns() -> None:
    # uncapped, random search over 1..1024 needs more than 14 guesses about a quarter of the time
    # (a demonstration that loses is refused by the warm-start); capped, it bisects in time
    rng = random.Random(0)
    targets = [rng.randint(1, 1024) for _ in range(400)]
    uncapped = [random_search_replies(t, 1024, random.Random(i)) for i, t in enumerate(targets)]
    capped = [random_search_replies(t, 1024, random.Random(i), max_guesses=14) for i, t in enumerate(targets)]
    assert any(len(g) > 14 for g in uncapped)
    assert all(len(g) <= 14 and g[-1] == str(t) for g, t in zip(capped, targets, strict=True))
    assert statistics.mean(len(g) for g in capped) > 10  # still random, not bisection (about 9)


async def test_said_bounds_narrow_and_ignore_guesses_outside_them(tokenizer: Any) -> None:
    env = GuessNumberEnv(GuessArgs(high=64, say_bounds=True))
    replies = ["32", "48", "50", "40", "44", "43"]  # 50 lies outside 33..47 and leaves it so
    traj = await run_episode(env, task(43), ScriptedPolicy(replies, tokenizer), tokenizer)
    said = [tokenizer.decode(t.prompt_ids).split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
            for t in traj.turns[1:]]
    assert said == ["Higher. From 33 to 64.", "Lower. From 33 to 47.", "Lower. From 33 to 47.",
                    "Higher. From 41 to 47.", "Lower. From 41 to 43."]
    assert traj.reward == pytest.approx(2.0 - 0.6) and traj.metrics["num_guesses"] == 6
