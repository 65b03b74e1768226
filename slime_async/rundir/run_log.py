"""A run's story across restarts and `--resume`: its events file, and the metrics of steps undone.

`<run dir>/events.jsonl` holds one line per event (a part died, was restarted, the trainer went back
to a checkpoint), appended by whoever saw it: the launcher and the trainer. A resumed run keeps the
lines of its earlier attempts, so the summary tells the whole story.

A trainer that comes back from the checkpoint at version N undoes the steps after N: their lines
leave `metrics.jsonl` (which then says what the weights went through, versions increasing), and
one event says how many steps of compute the restart cost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
TRAINED_IDS = "trained_ids.jsonl"
"""One line per applied step: its version and the ids of the trajectories it trained."""


def append_event(run_dir: Path, message: str, **fields: Any) -> None:
    """One line, written whole (O_APPEND: the launcher and the trainer may append at once)."""
    line = json.dumps({"time": time.time(), "event": message, **fields}) + "\n"
    fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] when there is none), without a line being written or cut."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / EVENTS)


def roll_back_metrics(path: Path, version: int) -> int | None:
    """Drop the lines of versions after `version` from the metrics file (atomically); returns the
    newest version dropped, or None when there was none."""
    if not path.exists():
        return None
    kept, newest = [], None
    for line in path.read_text().splitlines():
        try:
            v = json.loads(line).get("version")
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        if isinstance(v, int) and v > version:
            newest = max(newest or v, v)
        else:
            kept.append(line)
    if newest is None:
        return None
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
    return newest
