"""On-policy distillation's trainer half: the teacher's logprobs through the wire, into the batch, into a
per-token reverse-KL advantage, and a real torch step that pulls the student towards the teacher."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slime_async.config.schema import DistillConfig, TrainConfig
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend
from slime_async.types import StopReason, Trajectory, Turn, from_json, from_msgpack, to_json, to_msgpack


def scored(traj: Trajectory, value: float) -> Trajectory:
    for t in traj.turns:
        t.teacher_logprobs = np.full(len(t.completion_ids), value, np.float32)
    return traj


def test_teacher_logprobs_cross_the_wire_and_are_checked() -> None:
    t = Turn(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-1, -2], versions=[0, 0], teacher_logprobs=[-0.5, -3])
    traj = Trajectory(task_id="t", group_id="g", sample_index=0, turns=[t], stop_reason=StopReason.DONE)
    for back in (from_msgpack(to_msgpack(traj), Trajectory), from_json(to_json(traj), Trajectory)):
        assert back.turns[0].teacher_logprobs.tolist() == [-0.5, -3.0]
        assert back.turns[0].teacher_logprobs.dtype == np.float32
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries but completion_ids has 2"):
        Turn(prompt_ids=[1], completion_ids=[3, 4], logprobs=[-1, -2], versions=[0, 0], teacher_logprobs=[-1.0])


def test_batch_carries_the_teacher_on_scored_completion_tokens_only() -> None:
    trajs = make_trajectories(4, turns=2)
    scored(trajs[0], -0.25)
    scored(trajs[1], -0.75)
    trajs[1].turns[1].teacher_logprobs = None  # one turn unscored
    trajs[1].turns[0].teacher_logprobs[0] = np.nan  # a garbage score is masked, never trained on
    b = build_batch(trajs, max_seq_len=64).batch
    assert b is not None and b.teacher_logprobs is not None and b.teacher_mask is not None
    # row 0: every trained token scored, at the teacher's value
    assert torch.equal(b.teacher_mask[0], b.loss_mask[0])
    assert torch.all(b.teacher_logprobs[0][b.loss_mask[0] > 0] == -0.25)
    # row 1: only its first turn's tokens after the NaN
    first = trajs[1].turns[0]
    start = len(first.prompt_ids)
    expected = torch.zeros_like(b.loss_mask[1])
    expected[start + 1:start + len(first.completion_ids)] = 1
    assert torch.equal(b.teacher_mask[1], expected)
    assert b.teacher_mask[2:].sum() == 0 and b.teacher_logprobs[2:].abs().sum() == 0  # unscored trajectories
    assert b.rows(1, 3).teacher_mask.shape[0] == 2
    assert build_batch(make_trajectories(2), max_seq_len=64).batch.teacher_logprobs is None
    cut = build_batch([scored(make_trajectories(1)[0], -1.0)], max_seq_len=5).batch
    assert cut.teacher_mask.shape[1] == 5  # cut with the row


def test_the_reverse_kl_enters_each_scored_tokens_advantage() -> None:
    trajs = [scored(t, -0.5) for t in make_trajectories(2, group_size=2)] + make_trajectories(2, seed=1)
    b = build_batch(trajs, max_seq_len=64).batch
    plain = Objective(TrainConfig()).prepare(b, b.behaviour_logprobs)
    both = Objective(TrainConfig(distill=DistillConfig(model="t", coef=2.0))).prepare(b, b.behaviour_logprobs)
    # behaviour logprobs are -1, the teacher's -0.5: log pi - log q = -0.5, so the advantage rises by 1.0
    delta = both.advantages - plain.advantages
    assert torch.allclose(delta[b.teacher_mask > 0], torch.tensor(1.0))
    assert torch.all(delta[b.teacher_mask == 0] == 0)
    assert both.distill == {"distill/reverse_kl": pytest.approx(-0.5),
                            "distill/scored_fraction": pytest.approx(float(b.teacher_mask.sum() / b.loss_mask.sum()))}
    pure = Objective(TrainConfig(distill=DistillConfig(model="t", task_reward=False))).prepare(b, b.behaviour_logprobs)
    assert torch.allclose(pure.advantages, 0.5 * b.teacher_mask)  # the task's reward trains nothing
    metrics = Objective(TrainConfig(distill=DistillConfig(model="t"))).metrics(pure)
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.5)


def test_pure_distillation_steps_pull_the_student_towards_the_teacher(tiny_model_dir: Path,
                                                                      varied_model_dir: Path) -> None:
    """Real torch steps: the student (tiny model) on its own samples' tokens, scored by another model
    (the varied one), with no task reward: each token's logprob moves towards the teacher's."""
    cfg = TrainConfig(lr=3e-3, distill=DistillConfig(model="teacher", task_reward=False), micro_batch_size=8)
    student = TorchBackend(tiny_model_dir, device="cpu", optim=OptimizerSettings(lr=cfg.lr))  # type: ignore[arg-type]
    teacher = TorchBackend(varied_model_dir, device="cpu")  # type: ignore[arg-type]
    trajs = make_trajectories(8, group_size=4, turns=1)
    obj = Objective(cfg)

    def refreshed() -> tuple[Batch, float]:
        """The batch with the student's current logprobs as behaviour and the teacher's scores."""
        b = build_batch(trajs, max_seq_len=64).batch
        mine = student.logprobs(b, 1.0).logprobs
        theirs = teacher.logprobs(b, 1.0).logprobs
        for i, t in enumerate(trajs):
            turn = t.turns[0]
            k, n = len(turn.prompt_ids), len(turn.completion_ids)
            turn.logprobs = mine[i, k:k + n].numpy().astype(np.float32)
            turn.teacher_logprobs = theirs[i, k:k + n].numpy().astype(np.float32)
        b = build_batch(trajs, max_seq_len=64).batch
        gap = ((b.behaviour_logprobs - b.teacher_logprobs).abs() * b.teacher_mask).sum() / b.teacher_mask.sum()
        return b, float(gap)

    batch, first_gap = refreshed()
    for _ in range(5):
        prep = obj.prepare(batch, None)
        assert student.train_step(batch, obj.loss_fn(prep), 1.0).applied
        batch, gap = refreshed()
    assert gap < 0.5 * first_gap  # mean |log pi - log q| over the scored tokens
