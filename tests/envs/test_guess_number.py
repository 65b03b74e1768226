"""guess_number: binary search wins within 11 guesses; wrong or invalid guesses do not."""

from __future__ import annotations

import random
import statistics
from typing import Any

import msgspec
import pytest

from envs.guess_number import GuessArgs, GuessNumberEnv, binary_search_replies, random_search_replies, reward_for
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


def test_tasks_are_deterministic_and_both_splits_play_the_same_game() -> None:
    args = GuessArgs(high=64, num_train=2000, num_eval=2000)
    train, held_out = GuessNumberEnv.tasks(args, "train"), GuessNumberEnv.tasks(args, "eval")
    assert train == GuessNumberEnv.tasks(args, "train") and len({t.id for t in train}) == 2000
    assert not {t.id for t in train} & {t.id for t in held_out}
    assert [t.answer for t in train] != [t.answer for t in held_out]
    # the hidden target is the whole task: held-out games draw it from the same numbers (a split by
    # target would teach a policy trained on the rest that the held-out numbers never win)
    assert {t.answer for t in train} == {t.answer for t in held_out} == set(range(1, 65))


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
    # 32, 48, 40 and 44 were the middle of 1..64, 33..64, 33..47 and 41..47; 50 and 43 were not
    assert traj.metrics["midpoint_share"] == pytest.approx(4 / 6)


async def test_bisection_guesses_only_midpoints(tokenizer: Any) -> None:
    env = GuessNumberEnv(GuessArgs(high=64, say_bounds=True))
    replies = binary_search_replies(43, 64)
    traj = await run_episode(env, task(43), ScriptedPolicy(replies, tokenizer), tokenizer)
    assert traj.metrics["midpoint_share"] == 1.0 and traj.reward == reward_for(len(replies))


def test_demonstrations_mix_bisection_and_random_search() -> None:
    def demos(share: float) -> list[list[str]]:
        args = GuessArgs(high=64, num_train=400, demo_bisection=share)
        return [GuessNumberEnv.demonstration(args, t) for t in GuessNumberEnv.tasks(args, "train")]

    def bisects(game: list[str], target: int) -> bool:
        return game == binary_search_replies(target, 64)

    targets = [t.answer for t in GuessNumberEnv.tasks(GuessArgs(high=64, num_train=400), "train")]
    for share, low, high in ((0.0, 0, 0.05), (0.25, 0.18, 0.32), (1.0, 1.0, 1.0)):
        games = demos(share)
        assert all(g[-1] == str(t) and len(g) <= 14 for g, t in zip(games, targets, strict=True))
        # a random search bisects by chance only when its every guess happens to be a midpoint
        assert low <= sum(map(bisects, games, targets)) / len(games) <= high
    with pytest.raises(msgspec.ValidationError, match="demo_bisection"):
        msgspec.convert({"demo_bisection": 1.5}, GuessArgs)
