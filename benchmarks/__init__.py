"""Benchmarks, run as `slime-async bench NAME`.

Each module here that defines `DESCRIPTION` and `run(quick) -> Result` is a benchmark. Running
one prints its table, writes `benchmarks/results/NAME.json` and ends with its headline figure
against the goal its issue names.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pkgutil
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).with_name("results")


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


def run_benchmark(name: str, quick: bool = False, console: Console | None = None) -> Result:
    console = console or Console()
    module = importlib.import_module(f"benchmarks.{name}")
    console.print(f"[bold]{name}[/]: {module.DESCRIPTION}{' (quick)' if quick else ''}")
    result: Result = module.run(quick=quick)
    table = Table(title=name)
    labels = [_fmt(row[0]) for row in result.rows if row]
    for i, column in enumerate(result.columns):
        # a row's label is never cut short (a narrow terminal wraps the figures' columns instead)
        table.add_column(column, no_wrap=i == 0, min_width=max(map(len, labels), default=None) if i == 0 else None)
    for row in result.rows:
        table.add_row(*(_fmt(v) for v in row))
    console.print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{name}.json"
    record = {
        "benchmark": name,
        "quick": quick,
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
