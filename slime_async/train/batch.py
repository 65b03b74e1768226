"""From `list[Trajectory]` to padded tensors, skipping or truncating bad trajectories (counted).

Each trajectory becomes one row: its turns concatenated (`Trajectory.flat()`), right-padded to the
longest row; a trajectory of several segments (a template or an agent that rewrote history:
`Trajectory.segments()`) becomes one row per segment, each with the trajectory's reward and group.
Per-token tensors are aligned with the tokens: entry t of `behaviour_logprobs` is the
engine's log p(token t | tokens before t), and `loss_mask[t]` says whether token t trains. Token 0
never trains (nothing precedes it to predict it from).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from slime_async.types import StopReason, Trajectory

_OUT_OF_TOKENS = (StopReason.TRUNCATED, StopReason.MAX_TOKENS)
"""Stop reasons of an episode cut short by its token budget: its reply never ended."""

SkipReason = Literal["nan_reward", "nan_logprob", "bad_token", "overlong", "no_trainable_tokens"]


@dataclass
class Batch:
    """Padded rows of one training batch (CPU tensors; the backend moves them to its device)."""

    input_ids: torch.Tensor
    """[N, T] int64, right-padded with 0."""
    attention_mask: torch.Tensor
    """[N, T] int64: 1 on real tokens."""
    loss_mask: torch.Tensor
    """[N, T] float32: 1 on tokens that train."""
    behaviour_logprobs: torch.Tensor
    """[N, T] float32: the engine's logprobs (0 on prompt and padding)."""
    rewards: torch.Tensor
    """[N] float32."""
    group_index: torch.Tensor
    """[N] int64: dense group ids 0..G-1 (trajectories of one `group_id` share one)."""
    min_versions: torch.Tensor
    """[N] int64: oldest weight version among each row's generated tokens (-1 if none)."""
    trajectory_ids: list[str] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    """[N, T, layers x top_k] int16 for routing replay: the experts the engine chose for each token,
    -1 where it reported none (the trainer routes that token itself). None: no replay."""
    teacher_logprobs: torch.Tensor | None = None
    """[N, T] float32 for on-policy distillation: the teacher's logprob of each completion token
    (`Turn.teacher_logprobs`), 0 where `teacher_mask` is 0. None: no trajectory of the batch was scored."""
    teacher_mask: torch.Tensor | None = None
    """[N, T] float32: 1 on the tokens the teacher scored (a trajectory the teacher could not score
    has none: it trains without the KL term)."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trajectories(self) -> int:
        """Trajectories behind the rows (a trajectory of several segments has a row for each)."""
        return len(set(self.trajectory_ids))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def rows(self, start: int, stop: int) -> Batch:
        """Rows start..stop, trimmed to their own longest sequence (a micro-batch)."""
        length = max(1, int(self.attention_mask[start:stop].sum(dim=1).max())) if stop > start else 1
        return Batch(
            input_ids=self.input_ids[start:stop, :length],
            attention_mask=self.attention_mask[start:stop, :length],
            loss_mask=self.loss_mask[start:stop, :length],
            behaviour_logprobs=self.behaviour_logprobs[start:stop, :length],
            rewards=self.rewards[start:stop],
            group_index=self.group_index[start:stop],
            min_versions=self.min_versions[start:stop],
            trajectory_ids=self.trajectory_ids[start:stop],
            routed_experts=None if self.routed_experts is None else self.routed_experts[start:stop, :length],
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[start:stop, :length],
            teacher_mask=None if self.teacher_mask is None else self.teacher_mask[start:stop, :length],
        )


@dataclass
class BuildResult:
    batch: Batch | None
    """None when nothing trainable is left."""
    skipped: Counter[str]
    """Trajectories left out, by reason (`SkipReason`)."""
    truncated: int
    """Trajectories cut to `max_seq_len` (still trained on the part that remains)."""
    masked: int = 0
    """Episodes that ran out of tokens, kept for their group's baseline with no token trained
    (`mask_truncated`)."""
    unmasked: int = 0
    """Episodes that ran out of tokens and trained all the same, because every row of the batch had
    (`mask_truncated` leaves at least one row of a batch trainable; see `build_batch`)."""
    unrouted: int = 0
    """Rows trained without routing replay although it was asked for: their trajectory carried no
    routed-experts record, or one of another width (another model's)."""


def build_batch(
    trajectories: list[Trajectory],
    max_seq_len: int,
    overlong: Literal["truncate", "skip"] = "truncate",
    vocab_size: int | None = None,
    mask_truncated: bool = False,
    route_width: int | None = None,
) -> BuildResult:
    """Rows for `trajectories`; bad ones are skipped with a counted reason, never raised.

    A trajectory is skipped when its reward is not finite, when a trained token's logprob is not
    finite (or positive), when a token id is outside `vocab_size`, when it is longer than
    `max_seq_len` and `overlong` is `skip`, or when nothing in it trains (after truncation).
    With `mask_truncated`, an episode that ran out of tokens (`StopReason.TRUNCATED`, `MAX_TOKENS`)
    keeps its row, so its reward still counts in its group's baseline, but none of its tokens trains
    unless every row of the batch ran out of tokens: a batch that trains nothing leaves the version
    where it is, and the rollout's staleness bound then admits no new episode (the run stalls). Such a
    batch trains as without `mask_truncated`; in a group whose rewards are all equal the advantages
    are 0 anyway.
    With `route_width` (layers x top_k of an MoE model with routing replay), rows carry the engine's
    routed experts (`Batch.routed_experts`); rows without a record of that width are counted.
    """
    if max_seq_len < 2:
        raise ValueError(f"train.max_seq_len: must be at least 2, got {max_seq_len}")
    skipped: Counter[str] = Counter()
    truncated = 0
    kept: list[tuple[Trajectory, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None,
                     tuple[np.ndarray, np.ndarray] | None]] = []
    for traj in trajectories:
        if not np.isfinite(traj.reward):
            skipped["nan_reward"] += 1
            continue
        rows, reason, cut = [], None, False
        segments = traj.segments()
        routes = segment_routes(traj, route_width) if route_width else [None] * len(segments)
        teachers = segment_teacher(traj)
        for (ids, logprobs, mask), route, teacher in zip(segments, routes, teachers, strict=True):
            mask = mask.astype(np.float32)
            if len(mask):
                mask[0] = 0.0  # token 0 has no context to be predicted from
            trained = mask > 0
            if trained.any() and not (np.isfinite(logprobs[trained]).all() and (logprobs[trained] <= 0).all()):
                reason = "nan_logprob"
                break
            if vocab_size is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                reason = "bad_token"
                break
            if len(ids) > max_seq_len:
                if overlong == "skip":
                    reason = "overlong"
                    break
                ids, logprobs, mask = ids[:max_seq_len], logprobs[:max_seq_len], mask[:max_seq_len]
                route = None if route is None else route[:max_seq_len]
                teacher = None if teacher is None else (teacher[0][:max_seq_len], teacher[1][:max_seq_len])
                cut = True
            if (mask > 0).any():  # a segment with nothing to train on adds no row
                rows.append((traj, ids, logprobs, mask, route, teacher))
        truncated += cut  # counted also when nothing of it is left to train (as `no_trainable_tokens`)
        if reason is None and not rows:
            reason = "no_trainable_tokens"
        if reason is not None:
            skipped[reason] += 1
            continue
        kept += rows
    if not kept:
        return BuildResult(None, skipped, truncated)
    cut = len({t.id for t, *_ in kept if t.stop_reason in _OUT_OF_TOKENS}) if mask_truncated else 0
    masked, unmasked = (0, cut) if cut == len({t.id for t, *_ in kept}) else (cut, 0)
    if masked:
        kept = [(t, ids, lp, np.zeros_like(m) if t.stop_reason in _OUT_OF_TOKENS else m, r, te)
                for t, ids, lp, m, r, te in kept]
    n, length = len(kept), max(len(k[1]) for k in kept)
    input_ids = torch.zeros(n, length, dtype=torch.int64)
    attention = torch.zeros(n, length, dtype=torch.int64)
    loss_mask = torch.zeros(n, length, dtype=torch.float32)
    behaviour = torch.zeros(n, length, dtype=torch.float32)
    routed = torch.full((n, length, route_width), -1, dtype=torch.int16) if route_width else None
    scored = any(k[5] is not None for k in kept)
    teacher_lp = torch.zeros(n, length, dtype=torch.float32) if scored else None
    teacher_mask = torch.zeros(n, length, dtype=torch.float32) if scored else None
    unrouted = 0
    groups: dict[str, int] = {}
    for i, (traj, ids, logprobs, mask, route, teacher) in enumerate(kept):
        k = len(ids)
        input_ids[i, :k] = torch.from_numpy(ids.astype(np.int64))
        attention[i, :k] = 1
        loss_mask[i, :k] = torch.from_numpy(mask)
        behaviour[i, :k] = torch.from_numpy(np.where(mask > 0, logprobs, 0.0).astype(np.float32))
        if routed is not None:
            if route is None:
                unrouted += 1
            else:
                routed[i, :k] = torch.from_numpy(route)
        if teacher is not None and teacher_lp is not None and teacher_mask is not None:
            values, scored_mask = teacher
            teacher_mask[i, :k] = torch.from_numpy(scored_mask * (mask > 0))
            teacher_lp[i, :k] = torch.from_numpy(np.where(teacher_mask[i, :k].numpy() > 0, values, 0.0))
        groups.setdefault(traj.group_id, len(groups))
    return BuildResult(
        Batch(
            input_ids=input_ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            behaviour_logprobs=behaviour,
            rewards=torch.tensor([t.reward for t, *_ in kept], dtype=torch.float32),
            group_index=torch.tensor([groups[t.group_id] for t, *_ in kept], dtype=torch.int64),
            min_versions=torch.tensor(
                [v if (v := t.min_version()) is not None else -1 for t, *_ in kept], dtype=torch.int64),
            trajectory_ids=[t.id for t, *_ in kept],
            routed_experts=routed,
            teacher_logprobs=teacher_lp,
            teacher_mask=teacher_mask,
        ),
        skipped,
        truncated,
        masked,
        unmasked,
        unrouted,
    )


def segment_routes(traj: Trajectory, width: int) -> list[np.ndarray | None]:
    """Each segment's routed experts as int16 [tokens, width] (-1 where unreported), aligned with
    `Trajectory.segments()`; None for a segment with no record of this width at all."""
    out: list[np.ndarray | None] = []
    parts: list[np.ndarray] = []
    seen = False
    for i, t in enumerate(traj.turns):
        if t.new_branch and i > 0:
            out.append(np.concatenate(parts) if seen else None)
            parts, seen = [], False
        tokens = len(t.prompt_ids) + len(t.completion_ids)
        rec = t.routed_experts
        if rec is not None and len(rec) == tokens * width:
            rows = rec.reshape(tokens, width).astype(np.int16)
            if rec.dtype == np.uint8:
                rows[rec.reshape(tokens, width) == 255] = -1
            parts.append(rows)
            seen = True
        else:
            parts.append(np.full((tokens, width), -1, dtype=np.int16))
    if traj.turns:
        out.append(np.concatenate(parts) if seen else None)
    return out


def segment_teacher(traj: Trajectory) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each segment's teacher logprobs and scored mask (float32 [tokens] each, aligned with
    `Trajectory.segments()`; 0 on prompt tokens and on turns the teacher did not score, and on
    scores that are not finite or positive); None for a segment with no scored turn."""
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    values: list[np.ndarray] = []
    scored: list[np.ndarray] = []
    seen = False
    for i, t in enumerate(traj.turns):
        if t.new_branch and i > 0:
            out.append((np.concatenate(values), np.concatenate(scored)) if seen else None)
            values, scored, seen = [], [], False
        n = len(t.completion_ids)
        values.append(np.zeros(len(t.prompt_ids), np.float32))
        scored.append(np.zeros(len(t.prompt_ids), np.float32))
        if t.teacher_logprobs is not None:
            lp = t.teacher_logprobs.astype(np.float32)
            ok = np.isfinite(lp) & (lp <= 0)
            values.append(np.where(ok, lp, 0.0).astype(np.float32))
            scored.append(ok.astype(np.float32))
            seen = True
        else:
            values.append(np.zeros(n, np.float32))
            scored.append(np.zeros(n, np.float32))
    if traj.turns:
        out.append((np.concatenate(values), np.concatenate(scored)) if seen else None)
    return out
