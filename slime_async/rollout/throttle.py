"""One warning per condition and period, with a count of those held back.

Many episodes hit the same failure at once (an engine dies: every request in flight to it fails and
retries); a line for each buried the log (about 70 copies in 10 ms). A condition is a key (the
server and the kind of error); its first warning goes out at once, repeats within `every_s` are
counted, and the next one that goes out says how many were held back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter


class Throttled:
    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self.held: Counter[str] = Counter()
        """Warnings held back per condition since its last one went out."""

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log `message % args` unless `key` was logged within `every_s`; True when it went out."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self.held[key] += 1
            return False
        self._last[key] = now
        held = self.held.pop(key, 0)
        if held and last is not None:
            message += f" ({held} more like it in the last {now - last:.0f} s)"
        self.log.warning(message, *args)
        return True
