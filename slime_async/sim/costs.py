"""Cost models: what each part of a run costs in seconds, as functions fitted from measurements.

The simulator decides nothing with these; it only asks how long things take. Each model is a small
frozen dataclass whose numbers come from `slime_async.sim.fit` (benchmark results, a run's metrics).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCost:
    """One engine's continuous batching: the time of one decode step as a function of the batch.

    `points` are measured (batch, total tokens/s) pairs. Between them the step time (batch / tok/s)
    is interpolated linearly in the batch; past the last one it is extrapolated linearly from the
    last two (a decode step grows with the batch once compute or KV reads dominate), so total
    tokens/s keeps growing, ever more slowly. `max_batch` caps the requests decoded at once; more wait.
    `kv_s_per_token_ctx` adds, per request and per decode step, the time to read its KV cache
    (seconds per token of context): long reasoning contexts slow every step.
    `prefill_ratio` is what one prompt token costs in decode tokens of its request (prefill is
    modelled as extra work of that request, done at its decode rate).
    """

    points: tuple[tuple[float, float], ...]
    max_batch: int
    kv_s_per_token_ctx: float = 0.0
    mean_context: float = 0.0
    prefill_ratio: float = 0.05

    def __post_init__(self) -> None:
        if not self.points or any(b <= 0 or r <= 0 for b, r in self.points):
            raise ValueError(f"DecodeCost.points: need (batch > 0, tok/s > 0) pairs, got {self.points}")
        if self.max_batch < 1:
            raise ValueError(f"DecodeCost.max_batch must be >= 1, got {self.max_batch}")

    def step_s(self, batch: int) -> float:
        """Seconds of one decode step with `batch` requests running."""
        bs = [b for b, _ in self.points]
        steps = [b / r for b, r in self.points]
        if len(bs) == 1:
            base = steps[0] * batch / bs[0] if batch > bs[0] else steps[0]
        elif batch <= bs[0]:
            base = steps[0]
        else:
            i = min(bisect.bisect_left(bs, batch), len(bs) - 1)
            i = max(i, 1)
            b0, b1, s0, s1 = bs[i - 1], bs[i], steps[i - 1], steps[i]
            base = s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        return base + batch * self.kv_s_per_token_ctx * self.mean_context

    def per_request_rates(self) -> list[float]:
        """Tokens/s each request gets at batch 0..max_batch (index = batch; 0 at batch 0)."""
        return [0.0] + [1.0 / self.step_s(b) for b in range(1, self.max_batch + 1)]

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.step_s(batch)


@dataclass(frozen=True)
class TrainerCost:
    """One optimizer step over a batch: `fixed_s` plus tokens at `tokens_per_s` (all trainer GPUs)."""

    fixed_s: float
    tokens_per_s: float

    def step_s(self, tokens: float) -> float:
        return self.fixed_s + tokens / self.tokens_per_s


@dataclass(frozen=True)
class SyncCost:
    """Publishing new weights: the trainer is busy `fixed_s + bytes / bandwidth`; the engines stop
    generating only for `pause_s` of it (the in-place copy at the end)."""

    fixed_s: float
    bytes: float
    bandwidth_Bps: float
    pause_s: float

    @property
    def publish_s(self) -> float:
        return self.fixed_s + (self.bytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0)


@dataclass(frozen=True)
class IngestCost:
    """The buffer server takes trajectories one at a time (one process, its WAL): seconds each, and
    the transport's latency from a rollout worker to it."""

    per_trajectory_s: float
    latency_s: float = 0.0
