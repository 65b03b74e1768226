"""One run as the dashboard's charts see it: series over time and versions, books, staleness, health.

`RunView.snapshot()` is what the page polls: every series the charts draw, as columns (lists of the
same length), so the browser only plots. Files are re-read only when they changed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from slime_async.dashboard.store import StoreError, TrajectoryStore
from slime_async.rundir.run_files import JsonlFile, RunDirError, check_run_dir, health, read_json

METRIC_COLUMNS = ("version", "time", "elapsed_s", "reward_mean", "seconds", "trajectories", "tokens",
                  "publish_s", "max_staleness", "loss", "grad_norm", "clip_fraction", "ess")
ROLLOUT_HISTORY = 3600
"""Rollout samples kept per run (one per poll of a live run: about two hours at 2 s)."""


def _column(records: list[dict[str, Any]], key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in records:
        v = r.get(key)
        out.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None)
    return out


def _rate(num: list[float | None], den: list[float | None]) -> list[float | None]:
    return [n / d if n is not None and d else None for n, d in zip(num, den, strict=True)]


class RunView:
    """The files of one run directory, read for the page."""

    def __init__(self, path: Path) -> None:
        self.path = check_run_dir(Path(path))
        self.name = self.path.name
        self.metrics = JsonlFile(self.path / "metrics.jsonl")
        self.evals = JsonlFile(self.path / "eval.jsonl")
        self.books = JsonlFile(self.path / "buffer.jsonl")
        self.events = JsonlFile(self.path / "events.jsonl")
        self._store_key: tuple[tuple[int, int], ...] = ()
        self._store_cache: dict[str, Any] = {}
        self.rollout_history: deque[dict[str, float]] = deque(maxlen=ROLLOUT_HISTORY)
        """Rollout throughput sampled at each poll: workers keep only their latest figures."""

    @property
    def finished(self) -> bool:
        return (self.path / "summary.json").exists()

    def check(self) -> None:
        """Read every file once: RunDirError for a damaged one (the CLI says it before serving)."""
        live = not self.finished
        for f in (self.metrics, self.evals, self.books, self.events):
            f.read(live)

    def rollout(self) -> dict[str, Any]:
        """The rollout workers' latest figures, summed, and their history (sampled here)."""
        workers = [w for p in sorted(self.path.glob("rollout-*.json")) if isinstance(w := read_json(p), dict)]
        if not workers:
            return {"workers": 0, "history": list(self.rollout_history)}
        now = max(float(w.get("time", 0)) for w in workers)
        sample = {"time": now, "episodes_per_s": sum(w.get("episodes_per_s", 0) for w in workers),
                  "tokens_per_s": sum(w.get("tokens_per_s", 0) for w in workers),
                  "in_flight": sum(w.get("in_flight", 0) for w in workers)}
        if not self.rollout_history or self.rollout_history[-1]["time"] < now:
            self.rollout_history.append(sample)
        stops: dict[str, int] = {}
        for w in workers:
            for reason, n in w.get("stop_reasons", {}).items():
                stops[reason] = stops.get(reason, 0) + n
        return {"workers": len(workers), **sample, "episodes": sum(w.get("episodes", 0) for w in workers),
                "stop_reasons": stops, "history": list(self.rollout_history)}

    def snapshot(self, store: TrajectoryStore | None = None) -> dict[str, Any]:
        live = not self.finished
        records = self.metrics.read(live)
        cols: dict[str, list[float | None]] = {k: _column(records, k) for k in METRIC_COLUMNS}
        cols["samples_per_s"] = _rate(cols["trajectories"], cols["seconds"])
        cols["tokens_per_s"] = _rate(cols["tokens"], cols["seconds"])
        evals = self.evals.read(live)
        eval_keys = sorted({k for e in evals for k in e if k.endswith("/pass@1") or k.endswith("/mean_reward")})
        books = self.books.read(live)
        events = self.events.read(live)
        summary = read_json(self.path / "summary.json") if not live else None
        last_books = books[-1] if books else None
        if summary and summary.get("buffer"):
            last_books = {"version": (summary.get("last") or {}).get("version"), **summary["buffer"]}
        out: dict[str, Any] = {
            "name": self.name, "path": str(self.path), "live": live, "now": time.time(),
            "metrics": cols, "steps": len(records),
            "started": records[0]["time"] - records[0].get("elapsed_s", 0.0) if records else None,
            "eval": {"version": [e.get("version") for e in evals], "time": [e.get("time") for e in evals],
                     **{k: _column(evals, k) for k in eval_keys}},
            "books": {"version": _column(books, "version"), "time": _column(books, "time"),
                      **{k: _column(books, k) for k in ("received", "trained", "buffered", "dropped_total")}},
            "last_books": last_books,
            "rollout": self.rollout(),
            "events": events[-50:],
            "health": health(self.path, events, not live),
            "staleness": None, "store": None,
            "success": {k: summary.get(k) and {m: summary[k][m] for m in ("sampled", "greedy", "tasks")}
                        for k in ("success_before", "success_after")} if summary else
                       {"success_before": read_json(self.path / "success_before.json"), "success_after": None},
        }
        if store is not None and store.exists:
            try:
                out.update(self._store_figures(store))
            except StoreError as exc:
                out["store_error"] = str(exc)
        return out

    def _store_figures(self, store: TrajectoryStore) -> dict[str, Any]:
        """The store's aggregates, computed again only when its files changed (100,000 trajectories
        take ~100 ms to aggregate; a page polls every 2 s)."""
        key = tuple((st.st_size, st.st_mtime_ns) for p in (store.path, store.path.with_name(store.path.name + "-wal"))
                    if (st := _stat(p)) is not None)
        if key != self._store_key:
            self._store_cache = {"staleness": store.staleness(),
                                 "store": {"trajectories": store.count(), "per_step": store.per_step()}}
            self._store_key = key
        return self._store_cache


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def open_runs(paths: list[Path]) -> list[RunView]:
    """Every path as a run, checked (RunDirError naming the first that is not one or is damaged)."""
    runs = [RunView(p) for p in paths]
    names = [r.name for r in runs]
    for r in runs:
        r.check()
        if names.count(r.name) > 1:  # two runs/x from different places: tell them apart by parent
            r.name = f"{r.path.parent.name}/{r.name}"
    if not runs:
        raise RunDirError("no run directory given (slime-async dashboard runs/NAME [runs/OTHER ...])")
    return runs
