"""A black-box agent learns: `configs/calculator_agent.yaml` (an `openai` SDK program with its own tool
and reward, through the OpenAI-compatible endpoint) before and after 10 min of RL on 2 cores.

One run of the real `slime-async train`: the embedded default's cached warm-start, the success check
(through the agent), fully asynchronous RL for `train.time_limit_s`, the success check again. The
gain is the held-out sampled success after minus before.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = "black-box openai-SDK calculator agent: held-out success before/after 10 min of RL (goal >= +40 points)"
GOAL_POINTS = 40.0


def run(quick: bool = False) -> Result:
    minutes = 3.0 if quick else 10.0
    with tempfile.TemporaryDirectory(prefix="bench-blackbox-") as tmp:
        s = run_training("configs/calculator_agent.yaml", "blackbox", Path(tmp), [
            f"train.time_limit_s={minutes * 60}", "train.steps=100000"])
    before, after = s["success_before"], s["success_after"]
    gain = 100 * (after["sampled"] - before["sampled"])
    return Result(
        columns=["before sampled", "before greedy", "after sampled", "after greedy", "steps", "RL s"],
        rows=[[before["sampled"], before["greedy"], after["sampled"], after["greedy"], s["steps"], s["rl_s"]]],
        headline=f"black-box agent, held-out sampled success after {minutes:.0f} min of RL: {before['sampled']:.1%} "
                 f"-> {after['sampled']:.1%}, {gain:+.1f} points (goal +{GOAL_POINTS:.0f})",
        details={"run": {k: v for k, v in s.items() if k != "records"} | {"curve": [
            (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]}},
    )
