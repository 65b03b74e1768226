"""The harder task (`configs/two_step.yaml`: two dependent tool calls) before and after 15 min of RL.

One run of the real `slime-async train` (warm-start, success check, fully asynchronous RL for
`train.time_limit_s`, success after); the gain is the held-out sampled success after minus before.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = "two dependent tool calls: held-out success before/after 15 min of async RL (goal >= +40 points sampled)"
GOAL_POINTS = 40.0


def run(quick: bool = False) -> Result:
    minutes = 3.0 if quick else 15.0
    with tempfile.TemporaryDirectory(prefix="bench-two-step-") as tmp:
        s = run_training("configs/two_step.yaml", "two-step", Path(tmp), [
            f"train.time_limit_s={minutes * 60}", "train.steps=100000"])
    before, after = s["success_before"], s["success_after"]
    gain = 100 * (after["sampled"] - before["sampled"])
    return Result(
        columns=["before sampled", "before greedy", "after sampled", "after greedy", "steps", "RL s"],
        rows=[[before["sampled"], before["greedy"], after["sampled"], after["greedy"], s["steps"], s["rl_s"]]],
        headline=f"two-step task, held-out sampled success after {minutes:.0f} min of RL: {before['sampled']:.1%} -> "
                 f"{after['sampled']:.1%}, {gain:+.1f} points (goal +{GOAL_POINTS:.0f})",
        details={"run": {k: v for k, v in s.items() if k != "records"} | {"curve": [
            (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]}},
    )
