"""Chaos: SIGKILL of every part and of the launcher, then `--resume`; the run must be the same run.

A seeded schedule kills, once the trainer has reached each step, the trainer, the buffer, the
rollout worker, the engine and finally the launcher itself; `--resume` then finishes the run. The
books must hold: every trajectory id trained exactly once (the trainer's own record of ids per step
against the buffer's count), received = trained + buffered + dropped, versions in `metrics.jsonl`
increasing one by one, the events of both attempts and the success before RL kept, nothing left
running. (`slime-async bench chaos` adds the held-out success against an undisturbed run.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from test_train import REPO, command_lines, processes_mentioning, train_command

pytestmark = pytest.mark.slow
STEPS = 24
ROLES = {"trainer": "slime_async.train.worker", "buffer": "slime_async.buffer",
         "rollout-0": "slime_async.rollout.worker", "engine-0": " serve "}


def steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def pid_of(role: str, run: Path) -> int:
    # the engine's command line names the run's model (the warm-start), the others the run directory
    mark = str(run) if role != "engine-0" else yaml.safe_load((run / "config.yaml").read_text())["model"]["path"]
    mine = [p for p in processes_mentioning(mark) if ROLES[role] in " ".join(command_lines([p]))]
    assert len(mine) == 1, f"{role}: {command_lines(mine)}"
    return mine[0]


def test_every_part_killed_then_resumed_trains_each_trajectory_once(tmp_path: Path) -> None:
    run = tmp_path / "local"
    metrics = run / "metrics.jsonl"
    overrides = [f"train.steps={STEPS}", "train.checkpoint_every=3", "launch.max_restarts=2"]
    rng = random.Random(0)
    schedule = sorted(rng.sample(range(2, 15), 4))  # the steps after which trainer, buffer, rollout, engine die
    proc = subprocess.Popen(train_command(tmp_path, *overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, start_new_session=True)
    try:
        for role, at in zip(["trainer", "buffer", "rollout-0", "engine-0"], schedule, strict=True):
            deadline = time.monotonic() + 300
            while steps_done(metrics) < at:
                assert proc.poll() is None and time.monotonic() < deadline, f"the run never reached step {at}"
                time.sleep(0.1)
            os.kill(pid_of(role, run), signal.SIGKILL)
        deadline = time.monotonic() + 300
        while steps_done(metrics) < schedule[-1] + 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the run stopped after the kills"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher: no shutdown code runs in it; its children die with it
        proc.wait()
        # far more than a signalled process needs to exit; less than the >= 10 s that an orphaned
        # trainer ending gracefully spends waiting for a batch from the dead buffer (the buffer's
        # command line names its WAL, the others the run's config)
        deadline = time.monotonic() + 10
        while left := processes_mentioning(str(run / "config.yaml")) + processes_mentioning(str(run / "buffer-wal")):
            assert time.monotonic() < deadline, f"children outlived their launcher: {command_lines(left)}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    command = [("--resume" if arg == "--overwrite" else arg) for arg in train_command(tmp_path, *overrides)]
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    versions = [json.loads(line)["version"] for line in metrics.read_text().splitlines()]
    assert versions == list(range(1, STEPS + 1))  # one line per version, whatever was undone
    steps = [json.loads(line) for line in (run / "trained_ids.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == versions
    trained = Counter(i for s in steps for i in s["ids"])
    assert [i for i, n in trained.items() if n > 1] == [], "a trajectory was trained twice"
    summary = json.loads((run / "summary.json").read_text())
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"], b
    assert b["trained"] == sum(trained.values()) and b["applied"] == 0, (b, sum(trained.values()))
    events = " | ".join(summary["events"])
    for role in ("trainer", "buffer", "rollout-0", "engine-0"):
        assert f"{role} died" in events and f"{role} restarted" in events, events
    assert "resumed" in events, events
    assert summary["success_before"] is not None and summary["success_after"] is not None
    assert processes_mentioning(str(run / "config.yaml")) == []
