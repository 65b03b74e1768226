"""An in-memory `BatchSource`: trajectories handed out in the order they were added.

For tests, benchmarks and offline runs. `get_batch` waits (bounded by its timeout) for trajectories
to be `add`ed when none are left, as the buffer client does. The offset is checkpoint state, so a
resumed run continues where the first stopped (nothing trained twice, nothing skipped).
"""

from __future__ import annotations

import threading
from typing import Any

from slime_async.types import Trajectory


class InMemorySource:
    def __init__(self, trajectories: list[Trajectory] | None = None, loop: bool = False) -> None:
        self.trajectories: list[Trajectory] = list(trajectories or [])
        self.loop = loop
        """Start again from the beginning when exhausted (benchmarks), instead of waiting."""
        self.offset = 0
        self.version = 0
        self.versions_seen: list[int] = []
        self._cond = threading.Condition()

    def add(self, trajectories: list[Trajectory]) -> None:
        with self._cond:
            self.trajectories.extend(trajectories)
            self._cond.notify_all()

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        with self._cond:
            if self.offset >= len(self.trajectories) and self.loop and self.trajectories:
                self.offset = 0
            if not self._cond.wait_for(lambda: self.offset < len(self.trajectories), timeout=timeout):
                return None
            out = self.trajectories[self.offset : self.offset + n]
            self.offset += len(out)
            return out

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self.versions_seen.append(version)

    def commit(self, version: int) -> None:
        """Nothing to settle: the list is the source, and `offset` is in the checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self.offset = int(state["offset"])
