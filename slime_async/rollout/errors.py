"""What failed in a run's episodes, by name, with the first message of each.

A reward that raises scores its `on_error` value and the episode goes on; a tool that raises
becomes a message to the model; an env hook that raises ends the episode as `env_error`. None of
that stops a run, so none of it may be silent: the rollout counts each failure under its kind and
name (`reward exact`, `tool convert`, `group_reward rank`, `env_error`), keeps the first message of
each, and the live view, the rollout's stats file and the run summary show them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from slime_async.types import StopReason, Trajectory

ENDINGS = (StopReason.ENV_ERROR, StopReason.SERVER_ERROR)
"""Stop reasons that are failures, counted under their own value (`env_error`, `server_error`)."""


@dataclass
class ErrorBook:
    """Failures counted per `kind name`, and the first message of each."""

    counts: Counter[str] = field(default_factory=Counter)
    """Failed calls per name (a tool that fails twice in an episode counts 2; a reward, once an episode)."""
    first: dict[str, str] = field(default_factory=dict)

    def add(self, t: Trajectory) -> list[str]:
        """Count `t`'s failures; the names that failed for the first time (the caller logs them)."""
        failures = dict(t.errors)
        if t.stop_reason in ENDINGS:
            failures[t.stop_reason.value] = t.error
        new = [key for key in failures if key not in self.first]
        for key, message in failures.items():
            kind, _, name = key.partition(" ")
            self.counts[key] += int(t.metrics.get(f"{kind}_errors/{name}", 1)) if kind == "tool" else 1
            self.first.setdefault(key, message)
        return new

    def summary(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "first": dict(self.first)}


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' `ErrorBook.summary()`s as one (counts added, the first message of any)."""
    book = ErrorBook()
    for s in summaries:
        book.counts.update(s.get("counts", {}))
        for key, message in s.get("first", {}).items():
            book.first.setdefault(key, message)
    return book.summary()


def describe(summary: dict[str, Any], limit: int = 4, width: int = 160) -> list[str]:
    """The most frequent failures as lines: `reward exact: 12 (first: ZeroDivisionError: ...)`."""
    counts: dict[str, int] = summary.get("counts", {})
    lines = []
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]:
        message = " ".join(summary.get("first", {}).get(key, "").split())
        if len(message) > width:
            message = message[: width - 3] + "..."
        lines.append(f"{key}: {n}" + (f" (first: {message})" if message else ""))
    if len(counts) > limit:
        lines.append(f"... and {len(counts) - limit} more (rollout-*.json)")
    return lines
