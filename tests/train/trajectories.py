"""Trajectories made up for trainer tests (token ids inside the tiny model's vocabulary)."""

from __future__ import annotations

import numpy as np

from slime_async.types import StopReason, Trajectory, Turn


def make_trajectories(
    n: int, group_size: int = 2, seed: int = 0, vocab: int = 500, turns: int = 2, version: int = 0
) -> list[Trajectory]:
    """`n` trajectories in groups of `group_size`, each with `turns` turns of random tokens, a reward
    that differs within groups, and behaviour logprobs of -1 (tests that need real ones recompute)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ts = []
        for _ in range(turns):
            k = int(rng.integers(2, 7))
            ts.append(Turn(prompt_ids=rng.integers(0, vocab, int(rng.integers(1, 5))),
                           completion_ids=rng.integers(0, vocab, k), logprobs=np.full(k, -1.0),
                           versions=np.full(k, version)))
        out.append(Trajectory(task_id=f"t{i // group_size}", group_id=f"g{seed}-{i // group_size}",
                              sample_index=i % group_size, turns=ts, stop_reason=StopReason.DONE,
                              reward=float(rng.integers(0, 3))))
    return out
