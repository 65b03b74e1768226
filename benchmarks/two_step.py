"""The harder task (`configs/two_step.yaml`: two dependent tool calls) before and after 15 min of RL.

One run of the real `slime-async train` (warm-start, success check, fully asynchronous RL for
`train.time_limit_s`, success after); the gain is the held-out sampled success after minus before.
"""

from __future__ import annotations

from benchmarks import Result
from benchmarks._runs import timed_gain

DESCRIPTION = "two dependent tool calls: held-out success before/after 15 min of async RL (goal >= +40 points sampled)"
GOAL_POINTS = 40.0


def run(quick: bool = False) -> Result:
    return timed_gain("configs/two_step.yaml", "two-step", 3.0 if quick else 15.0, "two-step task", GOAL_POINTS)
