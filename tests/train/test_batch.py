"""Batch building: alignment with Trajectory.flat(), padding, and every skip reason counted."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from slime_async.train.batch import build_batch
from slime_async.train.synthetic import make_trajectories
from slime_async.types import StopReason, Trajectory, Turn


def traj(prompt: list[int], completion: list[int], logprobs: list[float], reward: float = 1.0,
         group: str = "g", mask: list[int] | None = None) -> Trajectory:
    turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, versions=[3] * len(completion),
                loss_mask=mask)
    return Trajectory(task_id="t", group_id=group, sample_index=0, turns=[turn], stop_reason=StopReason.DONE,
                      reward=reward)


def test_rows_follow_flat_and_are_right_padded() -> None:
    a = traj([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], reward=2.0, group="x", mask=[1, 0, 1])
    b = traj([7], [8], [-0.5], reward=0.0, group="y")
    c = traj([9], [9], [-0.5], group="x")
    out = build_batch([a, b, c], max_seq_len=16)
    batch = out.batch
    assert batch is not None and not out.skipped and out.truncated == 0
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [9, 9, 0, 0, 0]]
    assert batch.attention_mask.tolist()[1] == [1, 1, 0, 0, 0]
    assert batch.loss_mask.tolist()[0] == [0, 0, 1, 0, 1]
    np.testing.assert_allclose(batch.behaviour_logprobs[0].numpy(), [0, 0, -0.1, 0, -0.3], rtol=1e-6)
    assert batch.rewards.tolist() == [2.0, 0.0, 1.0]
    assert batch.group_index.tolist() == [0, 1, 0]
    assert batch.min_versions.tolist() == [3, 3, 3]
    assert batch.num_tokens == 9 and batch.num_trained_tokens == 4
    assert batch.rows(1, 3).input_ids.shape == (2, 2)  # trimmed to its own longest row


def test_bad_trajectories_are_skipped_and_counted() -> None:
    good = traj([1], [2, 3], [-1.0, -1.0])
    trajs = [
        good,
        traj([1], [2], [-1.0], reward=float("nan")),
        traj([1], [2, 3], [-1.0, float("nan")]),
        traj([1], [2, 3], [-1.0, 0.5]),  # a positive logprob is not a probability
        traj([1], [2, 999], [-1.0, -1.0]),  # outside the vocabulary
        traj([1], [2], [-1.0], mask=[0]),  # nothing trains
        traj([1] * 30, [2], [-1.0]),  # its only trained token falls past max_seq_len
    ]
    out = build_batch(trajs, max_seq_len=8, vocab_size=500)
    assert out.batch is not None and len(out.batch) == 1
    assert dict(out.skipped) == {"nan_reward": 1, "nan_logprob": 2, "bad_token": 1, "no_trainable_tokens": 2}
    assert out.truncated == 1


def test_overlong_truncate_or_skip() -> None:
    long = traj([1, 2], [3, 4, 5, 6, 7], [-1.0] * 5)
    cut = build_batch([long], max_seq_len=4)
    assert cut.batch is not None and cut.batch.input_ids.tolist() == [[1, 2, 3, 4]] and cut.truncated == 1
    skip = build_batch([long], max_seq_len=4, overlong="skip")
    assert skip.batch is None and dict(skip.skipped) == {"overlong": 1}


def test_empty_and_invalid() -> None:
    out = build_batch([], max_seq_len=8)
    assert out.batch is None and not out.skipped
    with pytest.raises(ValueError, match="max_seq_len"):
        build_batch(make_trajectories(1), max_seq_len=1)


def test_first_token_never_trains() -> None:
    t = Trajectory(task_id="t", group_id="g", sample_index=0, stop_reason=StopReason.DONE,
                   turns=[Turn(prompt_ids=[], completion_ids=[4, 5], logprobs=[-1.0, -2.0], versions=[0, 0])])
    batch = build_batch([t], max_seq_len=8).batch
    assert batch is not None and batch.loss_mask.tolist() == [[0, 1]]


def test_mask_truncated_keeps_the_reward_for_the_baseline_and_trains_none_of_the_tokens() -> None:
    done = traj([1], [2, 3], [-1.0, -1.0], reward=1.0)
    cut = msgspec.structs.replace(traj([1], [4, 5], [-1.0, -1.0], reward=0.0), stop_reason=StopReason.TRUNCATED)
    budget = msgspec.structs.replace(traj([1], [6, 7], [-1.0, -1.0], reward=0.0), stop_reason=StopReason.MAX_TOKENS)
    out = build_batch([done, cut, budget], max_seq_len=16, mask_truncated=True)
    assert out.batch is not None and out.masked == 2 and not out.skipped
    assert out.batch.rewards.tolist() == [1.0, 0.0, 0.0]  # the group's baseline still sees them
    assert out.batch.loss_mask.sum(dim=1).tolist() == [2.0, 0.0, 0.0]
    plain = build_batch([done, cut, budget], max_seq_len=16)
    assert plain.masked == 0 and plain.batch is not None and plain.batch.num_trained_tokens == 6
    # A batch of nothing but cut-off replies trains as without the mask: a batch that trains nothing
    # would never move the version, and the rollout's staleness bound would stall the run.
    alone = build_batch([cut, budget], max_seq_len=16, mask_truncated=True)
    assert alone.batch is not None and alone.masked == 0 and alone.unmasked == 2 and not alone.skipped
    assert alone.batch.loss_mask.sum(dim=1).tolist() == [2.0, 2.0]
