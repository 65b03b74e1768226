"""Made-up trajectories for tests and benchmarks of the trainer: random token ids inside a vocabulary.

One builder for both, so that a bench's batches and a test's batches have the same structure (groups,
turns, logprobs, versions, rewards that differ within a group). Two shapes:

- `tokens=None` (the tests'): each turn a prompt of 1-4 and a completion of 2-6 random tokens;
- `tokens=T` (the benches'): one turn per trajectory, a prompt of T // 4 tokens and a completion of
  the rest, so that every sequence is exactly T tokens long.
"""

from __future__ import annotations

import numpy as np

from slime_async.types import StopReason, Trajectory, Turn


def make_trajectories(
    n: int, group_size: int = 2, seed: int = 0, vocab: int = 500, turns: int = 2, version: int = 0, *,
    tokens: int | None = None, logprob: float = -1.0, reward_levels: int = 3,
) -> list[Trajectory]:
    """`n` trajectories in groups of `group_size`, each with `turns` turns of random tokens (or one turn
    of exactly `tokens`), a random reward in 0..`reward_levels` - 1, behaviour logprobs of `logprob`
    (tests that need real ones recompute) and every token at weight `version`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ts = []
        if tokens is None:
            for _ in range(turns):
                k = int(rng.integers(2, 7))
                ts.append(Turn(prompt_ids=rng.integers(0, vocab, int(rng.integers(1, 5))),
                               completion_ids=rng.integers(0, vocab, k), logprobs=np.full(k, logprob),
                               versions=np.full(k, version)))
        else:
            prompt = tokens // 4
            k = tokens - prompt
            ts.append(Turn(prompt_ids=rng.integers(0, vocab, prompt), completion_ids=rng.integers(0, vocab, k),
                           logprobs=np.full(k, logprob), versions=np.full(k, version, dtype=np.int32)))
        out.append(Trajectory(task_id=f"t{i // group_size}", group_id=f"g{seed}-{i // group_size}",
                              sample_index=i % group_size, turns=ts, stop_reason=StopReason.DONE,
                              reward=float(rng.integers(0, reward_levels))))
    return out
