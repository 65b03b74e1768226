"""Running `slime-async train` from a benchmark: the real command as a process, its run directory read back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks import Result

REPO = Path(__file__).resolve().parents[1]


def run_training(config: str, name: str, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One `slime-async train` run as a process; its summary plus its eval rounds and step records. Its
    output goes to `run_dir/NAME.log` as it comes (a run cut off by a time limit leaves what it said)."""
    cmd = [sys.executable, "-m", "slime_async.cli", "train", str(REPO / config), "--overwrite",
           f"run.name={name}", f"run.dir={run_dir}", *overrides]
    print(f"  {name}: slime-async train {config} {' '.join(overrides)}", flush=True)
    log = run_dir / f"{name}.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    # a bench stopped by SIGTERM (a time limit) takes its run with it: as an exception, subprocess.run
    # kills the launcher, whose parts die with it; the default action would leave them running on the GPU
    previous = signal.signal(signal.SIGTERM, _raise_exit) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        with log.open("w") as out:
            done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; the end of {log}:\n{log.read_text()[-4000:]}")
    run = run_dir / name
    summary = json.loads((run / "summary.json").read_text())
    summary["records"] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = summary.get("success_after") or {}
    print(f"  {name}: {summary['steps']} steps, RL {summary['rl_s']:.0f} s, success after "
          f"{after.get('sampled', float('nan')):.1%} sampled", flush=True)
    return summary


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


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


def timed_gain(config: str, name: str, minutes: float, what: str, goal_points: float) -> Result:
    """One run of `config` with RL bounded to `minutes`: held-out success before and after, and its gain
    in points against `goal_points` (the headline says `what` gained)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        s = run_training(config, name, Path(tmp), [f"train.time_limit_s={minutes * 60}", "train.steps=100000"])
    before, after = s["success_before"], s["success_after"]
    gain = 100 * (after["sampled"] - before["sampled"])
    return Result(
        columns=["before sampled", "before greedy", "after sampled", "after greedy", "steps", "RL s"],
        rows=[[before["sampled"], before["greedy"], after["sampled"], after["greedy"], s["steps"], s["rl_s"]]],
        headline=f"{what}, held-out sampled success after {minutes:.0f} min of RL: {before['sampled']:.1%} -> "
                 f"{after['sampled']:.1%}, {gain:+.1f} points (goal +{goal_points:.0f})",
        details={"run": {k: v for k, v in s.items() if k != "records"} | {"curve": [
            (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]}},
    )
