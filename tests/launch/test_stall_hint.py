"""The live view explains a trainer that gets no batch, instead of a run that looks busy and is not."""

from __future__ import annotations

from typing import Any

from slime_async.launch.train_run import stall_hint


def worker(reward: float | None, equal: int = 0, sent: int = 0) -> dict[str, Any]:
    return {"recent_reward": reward, "groups_dropped": {"equal_rewards": equal} if equal else {}, "groups_sent": sent}


def test_no_hint_while_steps_come() -> None:
    assert stall_hint(last_step_at=100.0, started_at=0.0, now=159.0, workers=[worker(0.0, equal=50)]) is None
    assert stall_hint(last_step_at=None, started_at=100.0, now=130.0, workers=[]) is None


def test_a_collapsed_policy_is_named() -> None:
    hint = stall_hint(last_step_at=100.0, started_at=0.0, now=175.0, workers=[worker(0.0, equal=2521)])
    assert hint is not None and hint.startswith("no trainer step for 75 s: no episode succeeds")
    assert "2521 so far" in hint and "train.lr" in hint


def test_a_task_every_episode_solves_is_named() -> None:
    hint = stall_hint(last_step_at=None, started_at=0.0, now=90.0, workers=[worker(1.0, equal=10), worker(0.995)])
    assert hint is not None and "every episode succeeds" in hint


def test_otherwise_the_rollout_is_pointed_at() -> None:
    for workers in ([worker(0.4, equal=30)], [worker(0.0)], []):
        hint = stall_hint(last_step_at=10.0, started_at=0.0, now=80.0, workers=workers)
        assert hint == "no trainer step for 70 s: waiting for whole groups from the rollout workers " \
                       "(their logs: logs/rollout-*.log)"
