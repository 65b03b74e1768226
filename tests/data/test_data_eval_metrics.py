"""pass@k and the suite metrics, as pure functions."""

from __future__ import annotations

from math import comb

import pytest

from slime_async.evaluation.metrics import group_metrics, pass_at_k, reward_metrics
from slime_async.types import StopReason, Trajectory, Turn


@pytest.mark.parametrize(("n", "c", "k"), [(5, 2, 1), (5, 2, 3), (10, 3, 2), (10, 0, 4), (8, 8, 1), (16, 1, 16)])
def test_pass_at_k_is_the_combinatorial_formula(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_1_is_the_success_rate_and_bad_arguments_are_errors() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="n=2, c=3, k=1"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)


def test_reward_metrics_average_over_tasks() -> None:
    m = reward_metrics([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], ks=[1, 2])
    assert m["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    assert m["mean_reward"] == pytest.approx(3 / 8) and m["num_tasks"] == 2 and m["num_samples"] == 8
    assert reward_metrics([[0.5, 0.9]], ks=[1], threshold=0.8)["pass@1"] == pytest.approx(0.5)


def test_group_metrics_add_stop_reasons_tokens_versions_and_env_metrics() -> None:
    def traj(reward: float, reason: StopReason, version: int, metrics: dict[str, float]) -> Trajectory:
        turn = Turn(prompt_ids=[1], completion_ids=[2, 3], logprobs=[-1.0, -1.0], versions=[version, version + 1])
        return Trajectory(task_id="t", group_id="g", sample_index=0, turns=[turn], stop_reason=reason, reward=reward,
                          metrics=metrics)

    m = group_metrics([[traj(1.0, StopReason.DONE, 3, {"guesses": 3.0, "calls": 1.0}),
                        traj(0.0, StopReason.TRUNCATED, 4, {"guesses": 6.0})]], ks=[1])
    # each env metric averaged over the episodes that report it (an env error may leave one out)
    assert m["metric/guesses"] == 4.5 and m["metric/calls"] == 1.0
    assert m["pass@1"] == 0.5 and m["stop/done"] == 0.5 and m["stop/truncated"] == 0.5
    assert m["mean_completion_tokens"] == 2.0 and m["version_min"] == 3.0 and m["version_max"] == 5.0
