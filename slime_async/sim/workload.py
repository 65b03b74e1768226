"""What the episodes of a run look like: turns, tokens, tool latencies, rewards, as distributions.

Sampled in blocks with numpy (one call per 65,536 episodes, not per episode): the simulator spends
its time on scheduling, not on drawing random numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_BLOCK = 65_536
_Z99 = 2.326347874  # standard normal quantile at 0.99


@dataclass(frozen=True)
class Lengths:
    """A positive quantity (tokens or seconds): lognormal with `median` and `sigma`, capped at `cap`;
    sigma 0 is the constant `median`."""

    median: float
    sigma: float = 0.0
    cap: float = math.inf

    def __post_init__(self) -> None:
        if self.median < 0 or self.sigma < 0 or self.cap <= 0:
            raise ValueError(f"Lengths: median and sigma must be >= 0 and cap > 0, got {self}")

    @classmethod
    def from_p99(cls, median: float, p99_factor: float, cap: float = math.inf) -> Lengths:
        """Lognormal whose 99th percentile is `p99_factor` times its median."""
        return cls(median, math.log(p99_factor) / _Z99 if p99_factor > 1 else 0.0, cap)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            return np.full(n, min(self.median, self.cap))
        return np.minimum(rng.lognormal(math.log(max(self.median, 1e-12)), self.sigma, n), self.cap)

    def mean(self) -> float:
        """Mean of the capped distribution (numerically, for reports)."""
        if self.sigma == 0:
            return min(self.median, self.cap)
        return float(self.sample(np.random.default_rng(0), 200_000).mean())


@dataclass(frozen=True)
class Workload:
    """One episode: a first prompt, then `1 + tool calls` model turns; after each turn but the last a
    tool call (its latency) whose response is appended to the context. Each episode's reward is 1 with
    probability `success_p` (what the equal-rewards filter sees)."""

    prompt_tokens: float
    completion_tokens: Lengths
    """Tokens generated per turn."""
    tool_calls_mean: float = 0.0
    """Mean tool calls per episode: floor(mean) for all, one more with the fractional part's probability."""
    tool_latency_s: Lengths = Lengths(0.0)
    tool_response_tokens: float = 0.0
    success_p: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.success_p <= 1.0:
            raise ValueError(f"Workload.success_p must be in [0, 1], got {self.success_p}")
        if self.tool_calls_mean < 0 or self.prompt_tokens < 0:
            raise ValueError(f"Workload: tool_calls_mean and prompt_tokens must be >= 0, got {self}")

    def tokens_per_episode(self) -> float:
        """Mean tokens an episode leaves for the trainer (prompt, completions, tool responses)."""
        turns = 1 + self.tool_calls_mean
        tools = self.tool_calls_mean * self.tool_response_tokens
        return self.prompt_tokens + turns * self.completion_tokens.mean() + tools


class EpisodeDraws:
    """An endless stream of sampled episodes: `next()` gives (turn lengths, tool latencies, reward)."""

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        self.w = workload
        self.rng = rng
        self._i = _BLOCK
        self._calls: list[int] = []
        self._reward: list[float] = []
        self._first: list[float] = []
        self._tokens = iter(())
        self._latency = iter(())

    def _refill(self) -> None:
        w, rng = self.w, self.rng
        base = math.floor(w.tool_calls_mean)
        calls = base + (rng.random(_BLOCK) < w.tool_calls_mean - base)
        self._calls = calls.tolist()
        self._reward = (rng.random(_BLOCK) < w.success_p).astype(float).tolist()
        total_turns = int(calls.sum()) + _BLOCK
        self._tokens = iter(np.maximum(1, np.rint(w.completion_tokens.sample(rng, total_turns))).tolist())
        self._latency = iter(w.tool_latency_s.sample(rng, int(calls.sum())).tolist())
        self._i = 0

    def next(self) -> tuple[list[float], list[float], float]:
        """Completion tokens of each turn, the latency of the tool call after each turn but the last,
        and the episode's reward."""
        if self._i >= _BLOCK:
            self._refill()
        i = self._i
        self._i += 1
        calls = self._calls[i]
        tokens = [next(self._tokens) for _ in range(calls + 1)]
        latencies = [next(self._latency) for _ in range(calls)]
        return tokens, latencies, self._reward[i]
