"""Running `slime-async train` from a benchmark: the real command as a process, its run directory read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_training(config: str, name: str, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One `slime-async train` run as a process; its summary plus its eval rounds and step records."""
    cmd = [sys.executable, "-m", "slime_async.cli", "train", str(REPO / config), "--overwrite",
           f"run.name={name}", f"run.dir={run_dir}", *overrides]
    print(f"  {name}: slime-async train {config} {' '.join(overrides)}", flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    run = run_dir / name
    summary = json.loads((run / "summary.json").read_text())
    summary["records"] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = summary.get("success_after") or {}
    print(f"  {name}: {summary['steps']} steps, RL {summary['rl_s']:.0f} s, success after "
          f"{after.get('sampled', float('nan')):.1%} sampled", flush=True)
    return summary


def crossing_s(summary: dict[str, Any], key: str, goal: float) -> float | None:
    """Seconds of RL (from the first step's start) until an eval round's `key` first reached `goal`."""
    records = summary["records"]
    if not records:
        return None
    t0 = records[0]["time"] - records[0]["seconds"]
    for line in summary["eval"]:
        if line.get(key, 0.0) >= goal:
            return line["time"] - t0
    return None
