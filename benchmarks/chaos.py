"""Crashes cost little: the embedded default undisturbed, and again under a seeded schedule of SIGKILLs.

Two runs of `slime-async train configs/local.yaml` (the cached warm-start, the same seed and steps).
In the second, after the steps of the schedule, each of the trainer, the buffer, the rollout worker
and the engine is killed (twice over), then the launcher itself, and `--resume` finishes the run.
Reported: steps of compute lost per trainer kill (the trainer goes back to its latest checkpoint:
at most `train.checkpoint_every - 1`), the buffer's stale-drop rate with and without the kills, the
books (every trajectory trained exactly once, received = trained + buffered + dropped) and the final
held-out success of both runs (goal: within 5 points).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from benchmarks import Result
from benchmarks._runs import REPO, run_training

DESCRIPTION = "SIGKILL every part and the launcher, --resume: lost steps per kill, stale drops, success vs undisturbed"
ROLES = {"trainer": "slime_async.train.worker", "buffer": "slime_async.buffer",
         "rollout-0": "slime_async.rollout.worker", "engine-0": " serve "}
GOAL_POINTS = 5.0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids(text: str) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and text in _cmdline(int(e.name))
            and int(e.name) != os.getpid()]


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill(role: str, run: Path, model: str) -> None:
    mark = model if role == "engine-0" else str(run)
    mine = [p for p in _pids(mark) if ROLES[role] in _cmdline(p)]
    if len(mine) != 1:
        raise RuntimeError(f"{role}: expected one process, found {[_cmdline(p)[:120] for p in mine]}")
    os.kill(mine[0], signal.SIGKILL)


def _wait_steps(proc: subprocess.Popen, run: Path, at: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while _steps(run) < at:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run stopped (or stalled) before step {at}")
        time.sleep(0.1)


def _chaos_run(run_dir: Path, name: str, overrides: list[str], schedule: list[tuple[int, str]]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "slime_async.cli", "train", str(REPO / "configs/local.yaml"), f"run.name={name}",
           f"run.dir={run_dir}", *overrides]
    run = run_dir / name
    print(f"  {name}: kills at {schedule}, then the launcher", flush=True)
    log = (run_dir / f"{name}-first.log").open("w")
    proc = subprocess.Popen([*cmd, "--overwrite"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)
    try:
        model = ""
        for at, role in schedule:
            _wait_steps(proc, run, at)
            if not model:
                model = yaml.safe_load((run / "config.yaml").read_text())["model"]["path"]
            _kill(role, run, model)
        _wait_steps(proc, run, schedule[-1][0] + 7)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher; its children die with it
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    deadline = time.monotonic() + 15
    while _pids(str(run / "config.yaml")):
        if time.monotonic() > deadline:
            raise RuntimeError("parts outlived their launcher")
        time.sleep(0.2)
    done = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"--resume failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = json.loads((run / "summary.json").read_text())
    summary["records"] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(x) for x in (run / "trained_ids.jsonl").read_text().splitlines()]
    trained = Counter(i for s in steps for i in s["ids"])
    summary["trained_twice"] = sum(1 for n in trained.values() if n > 1)
    summary["trained_ids"] = sum(trained.values())
    return summary


def _stale_rate(summary: dict[str, Any]) -> float:
    b = summary["buffer"]
    return b.get("dropped_stale", 0) / max(1, b["received"])


def run(quick: bool = False) -> Result:
    steps = 40 if quick else 120
    overrides = [f"train.steps={steps}", "data.eval_every=0", "launch.max_restarts=3"]
    rng = random.Random(0)
    roles = ["trainer", "buffer", "rollout-0", "engine-0"] * (1 if quick else 2)
    rng.shuffle(roles)
    ats = sorted(rng.sample(range(5, steps - 15), len(roles)))
    schedule = list(zip(ats, roles, strict=True))
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        calm = run_training("configs/local.yaml", "calm", Path(tmp), overrides)
        chaos = _chaos_run(Path(tmp), "chaos", overrides, schedule)
    rollbacks = [(e, int(m.group(1)) - int(m.group(2))) for e in chaos["events"]
                 if (m := re.search(r"went back from version (\d+) to its checkpoint at (\d+)", e))]
    trainer_kills = roles.count("trainer") + 1  # and the launcher's
    lost = [n for _, n in rollbacks]
    b = chaos["buffer"]
    books = b["received"] == b["trained"] + b["buffered"] + b["dropped_total"]
    gap = 100 * (chaos["success_after"]["sampled"] - calm["success_after"]["sampled"])
    rows = [
        ["undisturbed", 0, "-", f"{_stale_rate(calm):.1%}", calm["buffer"]["received"], calm["buffer"]["trained"],
         "-", calm["success_after"]["sampled"], calm["rl_s"]],
        ["chaos", len(schedule) + 1, f"{sum(lost) / trainer_kills:.1f}", f"{_stale_rate(chaos):.1%}",
         b["received"], b["trained"], chaos["trained_twice"], chaos["success_after"]["sampled"], chaos["rl_s"]],
    ]
    headline = (f"chaos: {len(schedule)} part kills + the launcher, --resume: {sum(lost) / trainer_kills:.1f} steps "
                f"of compute lost per trainer or launcher kill (checkpoint every 5), stale drops "
                f"{_stale_rate(chaos):.1%} vs {_stale_rate(calm):.1%} undisturbed, {chaos['trained_twice']} trained "
                f"twice, books {'balance' if books else 'DO NOT balance'}; held-out success {gap:+.1f} points vs "
                f"undisturbed (goal within {GOAL_POINTS:.0f})")
    return Result(
        columns=["run", "kills", "lost steps / trainer kill", "stale drops", "received", "trained", "trained twice",
                 "success after (sampled)", "RL s (last attempt)"],
        rows=rows, headline=headline,
        details={"schedule": schedule, "rollbacks": rollbacks, "events": chaos["events"],
                 "calm": {k: v for k, v in calm.items() if k != "records"},
                 "chaos": {k: v for k, v in chaos.items() if k != "records"}},
    )
