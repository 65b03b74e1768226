"""Evaluation metrics as pure functions of rewards: pass@k (unbiased), mean reward, per-suite summaries."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from slime_async.types import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n, c of them
    correct, is correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def reward_metrics(rewards: Sequence[Sequence[float]], ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
    """Metrics over tasks, each with its samples' rewards: `pass@k` for each k (a sample is correct
    when its reward >= threshold; averaged over tasks), `mean_reward` over all samples,
    `num_tasks`, `num_samples`."""
    if not rewards:
        return {"num_tasks": 0.0, "num_samples": 0.0}
    out: dict[str, float] = {}
    for k in ks:
        per_task = [pass_at_k(len(r), sum(x >= threshold for x in r), k) for r in rewards]
        out[f"pass@{k}"] = float(np.mean(per_task))
    flat = [x for r in rewards for x in r]
    out["mean_reward"] = float(np.mean(flat))
    out["num_tasks"] = float(len(rewards))
    out["num_samples"] = float(len(flat))
    return out


def group_metrics(groups: Sequence[Sequence[Trajectory]], ks: Sequence[int],
                  threshold: float = 1.0) -> dict[str, float]:
    """`reward_metrics` of finished groups, plus the share of each stop reason, the mean number of
    completion tokens, the oldest/newest weight version among their tokens (which policy was evaluated)
    and the mean of each of the env's `@metric`s as `metric/NAME` (over the episodes that report it)."""
    out = reward_metrics([[t.reward for t in g] for g in groups], ks, threshold)
    trajectories = [t for g in groups for t in g]
    if trajectories:
        reasons = Counter(t.stop_reason.value for t in trajectories)
        out.update({f"stop/{r}": n / len(trajectories) for r, n in sorted(reasons.items())})
        out["mean_completion_tokens"] = float(np.mean([t.num_completion_tokens for t in trajectories]))
        for name in sorted({k for t in trajectories for k in t.metrics}):
            out[f"metric/{name}"] = float(np.mean([t.metrics[name] for t in trajectories if name in t.metrics]))
        versions = [int(v) for t in trajectories for turn in t.turns for v in turn.versions]
        if versions:
            out["version_min"], out["version_max"] = float(min(versions)), float(max(versions))
    return out
