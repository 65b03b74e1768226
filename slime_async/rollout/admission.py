"""Staleness admission (AReaL's rule, docs/architecture.md "Staleness"), as one small testable class.

With B trajectories per optimizer step and bound eta, a new trajectory may start only while
`accepted + running < (v + eta + 1) * B`, where v is the weight version the engines serve,
`accepted` counts finished trajectories that were kept and `running` those in flight. A filtered
or failed trajectory frees its slot (or filtering would deadlock the run). eta = 0 is synchronous
on-policy through the same code. On resume, `accepted` restarts from what the trainer consumed.
"""

from __future__ import annotations

import asyncio


class StalenessBudget:
    """Counts and the admission rule; `acquire` waits (without polling) until a start is allowed."""

    def __init__(self, batch_size: int, max_staleness: int, version: int = 0, accepted: int = 0) -> None:
        if batch_size < 1 or max_staleness < 0:
            raise ValueError(f"batch_size must be >= 1 and max_staleness >= 0, got {batch_size}, {max_staleness}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version = version
        self.accepted = accepted
        self.running = 0
        self.waits = 0
        """How many starts had to wait for the trainer (a metric: rollout outran training)."""
        self._changed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_size

    def can_start(self) -> bool:
        return self.accepted + self.running < self.capacity

    def try_start(self) -> bool:
        """Count one more trajectory as running if the rule allows it now; False if it does not.
        The synchronous core of `acquire`, also driven directly by the cluster simulator (`slime_async.sim`)."""
        if not self.can_start():
            return False
        self.running += 1
        return True

    def finish(self, kept: bool) -> None:
        """The synchronous core of `release`: kept ones count as accepted; dropped ones free their slot."""
        if self.running <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self.running -= 1
        self.accepted += int(kept)

    async def acquire(self) -> None:
        """Wait until the rule allows one more trajectory, then count it as running."""
        async with self._changed:
            if not self.try_start():
                self.waits += 1
                await self._changed.wait_for(self.try_start)

    async def release(self, kept: bool) -> None:
        """A trajectory finished: kept ones count as accepted; dropped ones free their slot."""
        async with self._changed:
            self.finish(kept)
            self._changed.notify_all()

    async def recover(self, version: int, accepted: int) -> None:
        """The engines went back to `version` (a trainer restarted from its checkpoint there), and
        `accepted` is what the run has kept that the trainer has trained by then or has still to train
        (AReaL's `on_version_recovered`): the rule goes on from there, neither admitting past the
        bound nor waiting for trajectories that a rolled-back trainer will never get."""
        async with self._changed:
            self.version, self.accepted = version, accepted
            self._changed.notify_all()

    async def set_version(self, version: int) -> None:
        """The engines now serve `version` (learned from the weight-sync protocol). It goes back when
        the engines do (a trainer restarted from an older checkpoint, AReaL's `on_version_recovered`):
        admission then waits until the trainer has caught up with what was accepted."""
        async with self._changed:
            if version != self.version:
                self.version = version
                self._changed.notify_all()
