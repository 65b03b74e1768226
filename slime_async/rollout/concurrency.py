"""Episodes in flight, sized from the engines' own load (`rollout.adaptive_concurrency`), as one small rule.

A hand-set `rollout.max_concurrency` is wrong in one direction or the other. Too small, and the
engines idle while episodes sit in their tools between turns; too large, and requests queue inside
the engines, where each turn waits longer and its tokens grow staler without a token more per second.
The right number moves with the env's tool latency, the reply lengths and the engines' batch size, so
the worker measures instead of guessing. It asks the engines (SGLang's `GET /v1/loads`, vLLM's
`/metrics`) how many requests are running and how many wait for a batch slot; a waiting request is
the one sign that an engine is saturated, whatever its batch size.

The rule, once per period, from the engines' requests running and waiting and their batch slots
(summed over the engines; SGLang's `max_running_requests`, unknown for vLLM) and the episodes this
worker has in flight, with `slack` an eighth of the requests running (at least one):
- saturated (more waiting than `slack`, and the slots full to within `slack`, or the slots unknown):
  a new request only queues; the limit shrinks by a quarter, not below `floor`;
- held back by its own limit (the worker uses all of it) while the engines have room (nothing waits,
  or more than `slack` slots free): it grows, at first (slow start, so a run reaches its level in
  seconds) straight to the engines' slots or else double, then by an eighth (at least one), up to
  `ceiling`;
- anything else (a small queue, or a worker held back by the staleness budget rather than by its
  limit): it holds.
The slots matter because an engine also queues requests it has room for: the embedded engine admits
a bounded number of prompt tokens per prefill, SGLang schedules by its token budget, so requests wait
a step while slots are free, and more of them still raise its throughput. The slack keeps a short
queue on purpose: a request that ends frees its slot before the episode's next turn arrives, and a
queue of a few requests fills that gap without making every turn wait.

Check: with `max_concurrency` as the ceiling, `floor <= limit <= ceiling` always; a worker that cannot
read any engine's load keeps the limit it has (and says so once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from slime_async.rollout.client import EngineLoad

log = logging.getLogger(__name__)


class ConcurrencyGate:
    """A semaphore whose size can change while held: `acquire` waits while `in_flight >= limit`.
    A smaller limit takes effect as episodes end (none is cancelled)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a concurrency limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._waiters: list[asyncio.Future] = []

    async def acquire(self) -> None:
        while self.in_flight >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.in_flight += 1

    def release(self) -> None:
        """An episode ended (synchronous: it runs in `finally` blocks, of cancelled tasks too)."""
        if self.in_flight <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self.in_flight -= 1
        self._wake()

    def resize(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a concurrency limit must be >= 1, got {limit}")
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        # every waiter looks again (there is about one: groups are admitted one after another)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()


class AdaptiveLimit:
    """The rule of the module's header: `update(load, in_flight)` gives the next limit."""

    def __init__(self, floor: int, ceiling: int, start: int | None = None) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got floor {floor}, ceiling {ceiling}")
        self.floor, self.ceiling = floor, ceiling
        self.limit = min(ceiling, max(floor, start if start is not None else 2 * floor))
        self.slow_start = True
        """Doubling until the engines first queue; an eighth at a time after."""
        self.history: list[tuple[int, int, int]] = []
        """(running, waiting, limit) at each update with a load: for the run's stats and the bench."""

    def update(self, load: EngineLoad | None, in_flight: int) -> int:
        if load is None:
            return self.limit
        slack = max(1, load.running // 8)
        full = load.capacity is None or load.running >= load.capacity - slack
        room = load.waiting == 0 or (load.capacity is not None and load.running < load.capacity - slack)
        if load.waiting > slack and full:
            self.limit = max(self.floor, self.limit - max(1, self.limit // 4))
            self.slow_start = False
        elif in_flight >= self.limit and room:
            if self.slow_start:
                self.limit = max(2 * self.limit, load.capacity or 0)
            else:
                self.limit += max(1, self.limit // 8)
            self.limit = min(self.ceiling, self.limit)
        self.history.append((load.running, load.waiting, self.limit))
        del self.history[:-512]  # the recent past is what the stats show
        return self.limit


async def adapt(gate: ConcurrencyGate, rule: AdaptiveLimit, read_load: Callable[[], Awaitable[EngineLoad | None]],
                period_s: float = 0.5) -> None:
    """Resize `gate` by `rule` every `period_s` from the engines' load, until cancelled."""
    gate.resize(rule.limit)
    warned = False
    while True:
        await asyncio.sleep(period_s)  # a control period, not a wait for a condition
        load = await read_load()
        if load is None and not warned:
            warned = True
            log.warning("rollout.adaptive_concurrency: no engine answered its load route; episodes in flight stay "
                        "at %d (rollout.max_concurrency is the ceiling)", gate.limit)
        gate.resize(rule.update(load, gate.in_flight))
