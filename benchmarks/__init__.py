"""Benchmarks, run as `slime-async bench NAME`.

Each module here that defines `DESCRIPTION` and `run(quick) -> Result` is a benchmark. Running
one prints its table, writes `benchmarks/results/NAME.json` and ends with its headline figure
against the goal its issue names.

A benchmark that trains one config may name it in `OVERRIDES_OF` (its path); it then takes overrides of
that config (`slime-async bench learning train.loss=sapo`), as `run(quick, overrides)`, and writes
its results beside the plain run's, under a name that carries them (`learning+train.loss=sapo.json`).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pkgutil
import platform
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).with_name("results")
REPO_DIR = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """What a benchmark measured: a table, a headline line, and anything else worth keeping."""

    columns: list[str]
    rows: list[list[Any]]
    headline: str
    """One line: the figure against its goal, e.g. `speed-up vs lists: 4.1 (goal 3)`."""
    details: dict[str, Any] = field(default_factory=dict)


def available() -> dict[str, str]:
    """Benchmark names and what each measures."""
    out = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        if hasattr(module, "run") and hasattr(module, "DESCRIPTION"):
            out[info.name] = module.DESCRIPTION
    return out


def config_of(name: str) -> str | None:
    """The config a benchmark trains, whose overrides it takes (`OVERRIDES_OF`); None: it takes none."""
    return getattr(importlib.import_module(f"benchmarks.{name}"), "OVERRIDES_OF", None)


def results_path(name: str, overrides: list[str] | None = None) -> Path:
    """Where a run's record goes: `NAME.json`, or with overrides `NAME+key=value+....json` (the plain
    run's record is kept)."""
    tag = "".join("+" + re.sub(r"[^A-Za-z0-9._=-]", "_", o) for o in overrides or [])
    return RESULTS_DIR / f"{name}{tag}.json"


def run_benchmark(name: str, quick: bool = False, console: Console | None = None,
                  overrides: list[str] | None = None) -> Result:
    """Run one benchmark, print its table and headline, write its record. `overrides` (key=value) go to
    the config of a benchmark that has `OVERRIDES_OF`; others refuse them."""
    console = console or Console()
    module = importlib.import_module(f"benchmarks.{name}")
    overrides = list(overrides or [])
    if overrides and not hasattr(module, "OVERRIDES_OF"):
        raise ValueError(f"benchmark {name} takes no config overrides (those that do: "
                         f"{', '.join(n for n in available() if config_of(n))})")
    console.print(f"[bold]{name}[/]: {module.DESCRIPTION}{' (quick)' if quick else ''}"
                  f"{' with ' + ' '.join(overrides) if overrides else ''}")
    result: Result = module.run(quick=quick, overrides=overrides) if overrides else module.run(quick=quick)
    table = Table(title=name)
    labels = [_fmt(row[0]) for row in result.rows if row]
    for i, column in enumerate(result.columns):
        # a row's label is never cut short (a narrow terminal wraps the figures' columns instead)
        table.add_column(column, no_wrap=i == 0, min_width=max(map(len, labels), default=None) if i == 0 else None)
    for row in result.rows:
        table.add_row(*(_fmt(v) for v in row))
    console.print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = results_path(name, overrides)
    record = {
        "benchmark": name,
        "quick": quick,
        "overrides": overrides,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "columns": result.columns,
        "rows": result.rows,
        "headline": result.headline,
        "details": result.details,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"wrote {out}")
    console.print(result.headline, highlight=False, soft_wrap=True)
    return result


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _machine() -> dict[str, Any]:
    # $SLIME_ASYNC_BENCH_COMMIT: a copy of the tree elsewhere (the GPU machine's) may carry a stale .git
    commit = os.environ.get("SLIME_ASYNC_BENCH_COMMIT", "")
    try:
        commit = commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "commit": commit,
    }
