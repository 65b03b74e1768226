"""A run directory as the dashboard reads it: which files, what a damaged one is, and the parts' health.

What a run writes (and who): `config.yaml` (launcher), `metrics.jsonl` (trainer, one line per step),
`eval.jsonl` (evaluation worker), `buffer.jsonl` (trainer: the buffer's books after each step),
`rollout-<i>.json` (each rollout worker's latest figures), `events.jsonl` (deaths, restarts,
rollbacks), `parts.json` (the launcher: each part's process, alive or not, restarts; every second
while it runs), `summary.json` (the launcher, at the end) and `trajectories.sqlite` (trainer).

Every file is read from the directory alone: a run finished long ago opens like a live one. A line
still being appended (the last one, without its newline, while the run goes) is not an error; any
other line that is not JSON is, naming the file and the line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_MARKERS = ("config.yaml", "metrics.jsonl")
PARTS = "parts.json"
PARTS_STALE_S = 10.0
"""A `parts.json` older than this, in a run without a summary: the launcher is gone (killed)."""


class RunDirError(ValueError):
    """A directory that is not a run, or a run file that is damaged; the message names it and the fix."""


def check_run_dir(path: Path) -> Path:
    """`path` itself when it is a run directory, else RunDirError saying what it is instead."""
    if not path.exists():
        raise RunDirError(f"{path}: no such directory; give a run directory (runs/NAME, made by `slime-async train`)")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory; give a run directory (runs/NAME), not a file in it")
    if not any((path / m).exists() for m in RUN_MARKERS):
        inner = sorted(p.name for p in path.iterdir() if p.is_dir() and any((p / m).exists() for m in RUN_MARKERS))
        hint = f" (its sub-directories {', '.join(inner[:5])} are: give one of those)" if inner else ""
        raise RunDirError(f"{path}: not a run directory: it has neither config.yaml nor metrics.jsonl{hint}")
    return path


@dataclass
class _Cached:
    key: tuple[int, int] = (-1, -1)
    records: list[dict[str, Any]] = field(default_factory=list)


class JsonlFile:
    """A JSON-lines file read again only when it changed (size, mtime), checked line by line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cache = _Cached()

    def read(self, live: bool) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        key = (st.st_size, st.st_mtime_ns)
        if key != self._cache.key:
            self._cache = _Cached(key, parse_jsonl(self.path.read_bytes(), self.path, live))
        return self._cache.records


def parse_jsonl(data: bytes, path: Path, live: bool) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. `live`: its last line may still be being written."""
    lines = data.split(b"\n")
    tail_open = not data.endswith(b"\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) and tail_open and live:
                break  # being appended right now: the next read has it whole
            raise RunDirError(f"{path}: line {i} is not JSON ({exc.msg}): the file was cut short or damaged; "
                              "remove that line (a run resumed with --resume drops a cut line itself)") from None
        if not isinstance(record, dict):
            raise RunDirError(f"{path}: line {i} is {type(record).__name__}, not a JSON object")
        out.append(record)
    return out


def read_json(path: Path) -> Any:
    """A whole JSON file, or None when there is none (or it is being replaced right now)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # written whole by its writer (tmp + rename); a half file is a race, read next time


def write_parts(run_dir: Path, parts: list[Any]) -> None:
    """The launcher's parts as `parts.json` (atomically): name, pid, alive, restarts, finished."""
    rows = []
    for p in parts:
        child = p.child
        proc = getattr(child, "proc", None)
        alive = child.alive() if child is not None and hasattr(child, "alive") else None
        rows.append({"name": p.name, "pid": proc.pid if proc is not None else None, "alive": alive,
                     "restarts": p.restarts, "finished": p.finished})
    tmp = run_dir / f".{PARTS}.tmp"
    tmp.write_text(json.dumps({"time": time.time(), "parts": rows}))
    tmp.replace(run_dir / PARTS)


def health(run_dir: Path, events: list[dict[str, Any]], finished: bool, now: float | None = None) -> dict[str, Any]:
    """Each part's health: from `parts.json` while the launcher writes it, else from the events alone."""
    now = time.time() if now is None else now
    parts = read_json(run_dir / PARTS)
    deaths: dict[str, int] = {}
    for e in events:
        text = str(e.get("event", ""))
        name = text.split(" ", 1)[0]
        if " died" in text or "exited" in text:
            deaths[name] = deaths.get(name, 0) + 1
    if parts is None:
        return {"source": "events", "launcher": "finished" if finished else "unknown",
                "parts": [{"name": n, "alive": None, "restarts": None, "deaths": d, "pid": None}
                          for n, d in sorted(deaths.items())]}
    age = now - float(parts.get("time", 0))
    launcher = "finished" if finished else ("running" if age < PARTS_STALE_S else f"silent for {age:.0f} s")
    rows = []
    for p in parts.get("parts", []):
        # a part's state as of the last write; once the launcher stopped, nothing of the run is alive
        alive = p.get("alive") if launcher == "running" else False
        rows.append({**p, "alive": alive, "deaths": deaths.get(p.get("name", ""), 0)})
    return {"source": "launcher", "launcher": launcher, "age_s": age, "parts": rows}
