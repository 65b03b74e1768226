"""An inference engine under continuous batching, as a processor-sharing queue.

Every running request advances by the same tokens per second, which depends only on how many run
(`DecodeCost.per_request_rates`). So the engine keeps one counter, `served`: the tokens that each
request running since the start would have received. A request that joins when the counter is S and
needs T tokens ends when it reaches S + T. The earliest end is the top of a heap, and a change of
batch size changes only the rate, not the order: each event costs O(log batch), not O(batch).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any


class Engine:
    """One engine: at most `max_batch` requests decoding, the rest waiting in order of arrival."""

    __slots__ = (
        "_seq",
        "busy_s",
        "generation",
        "heap",
        "index",
        "last",
        "outstanding",
        "rates",
        "served",
        "speed",
        "version",
        "waiting",
    )

    def __init__(self, index: int, rates: list[float]) -> None:
        self.index = index
        self.rates = rates
        """Tokens/s per request at batch 0..max_batch."""
        self.served = 0.0
        self.last = 0.0
        self.heap: list[tuple[float, int, Any]] = []
        self.waiting: deque[tuple[float, Any]] = deque()
        self.speed = 1.0
        """1 normally; 0 while paused for a weight update; a share when it competes for CPUs."""
        self.generation = 0
        """Bumped at every change: a scheduled end event with an older generation is stale."""
        self.version = 0
        """The weight version it serves."""
        self.outstanding = 0
        """Requests on it (running and waiting): what the client's least-outstanding routing reads."""
        self.busy_s = 0.0
        """Seconds with at least one request running (utilisation)."""
        self._seq = 0

    @property
    def max_batch(self) -> int:
        return len(self.rates) - 1

    @property
    def running(self) -> int:
        return len(self.heap)

    def advance(self, now: float) -> None:
        """Bring `served` up to `now` at the current rate."""
        n = len(self.heap)
        if n:
            dt = now - self.last
            self.served += dt * self.rates[n] * self.speed
            if self.speed > 0:
                self.busy_s += dt
        self.last = now

    def submit(self, now: float, tokens: float, item: Any) -> bool:
        """Add a request needing `tokens` of decode work; True if it runs now, False if it waits."""
        self.advance(now)
        self.outstanding += 1
        if len(self.heap) < self.max_batch:
            self._seq += 1
            heapq.heappush(self.heap, (self.served + tokens, self._seq, item))
            return True
        self.waiting.append((tokens, item))
        return False

    def pop_finished(self, now: float) -> tuple[list[Any], list[Any]]:
        """Requests done by `now`, and those that started running in their place."""
        self.advance(now)
        done, started = [], []
        heap = self.heap
        limit = self.served + 1e-9 * max(1.0, self.served)
        while heap and heap[0][0] <= limit:
            done.append(heapq.heappop(heap)[2])
            self.outstanding -= 1
        while self.waiting and len(heap) < self.max_batch:
            tokens, item = self.waiting.popleft()
            self._seq += 1
            heapq.heappush(heap, (self.served + tokens, self._seq, item))
            started.append(item)
        return done, started

    def next_end(self) -> float | None:
        """When the next running request ends at the current rate (None: nothing runs, or paused)."""
        if not self.heap or self.speed <= 0:
            return None
        return self.last + (self.heap[0][0] - self.served) / (self.rates[len(self.heap)] * self.speed)
