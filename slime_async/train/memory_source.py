"""An in-memory `BatchSource`: a fixed list of trajectories handed out in order.

For tests, benchmarks and offline runs. It keeps its offset as checkpoint state, so a resumed run
continues where the first stopped (nothing trained twice, nothing skipped).
"""

from __future__ import annotations

import threading
from typing import Any

from slime_async.types import Trajectory


class InMemorySource:
    def __init__(self, trajectories: list[Trajectory], loop: bool = False) -> None:
        self.trajectories = trajectories
        self.loop = loop
        """Start again from the beginning when exhausted (otherwise return None)."""
        self.offset = 0
        self.version = 0
        self.versions_seen: list[int] = []
        self._lock = threading.Lock()

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        with self._lock:
            if self.offset >= len(self.trajectories):
                if not self.loop or not self.trajectories:
                    return None
                self.offset = 0
            out = self.trajectories[self.offset : self.offset + n]
            self.offset += len(out)
            return out

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = version
            self.versions_seen.append(version)

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = int(state["offset"])
