"""A black-box agent learns: `configs/calculator_agent.yaml` (an `openai` SDK program with its own tool
and reward, through the OpenAI-compatible endpoint) before and after 10 min of RL on 2 cores.

One run of the real `slime-async train`: the embedded default's cached warm-start, the success check
(through the agent), fully asynchronous RL for `train.time_limit_s`, the success check again. The
gain is the held-out sampled success after minus before.
"""

from __future__ import annotations

from benchmarks import Result
from benchmarks._runs import timed_gain

DESCRIPTION = "black-box openai-SDK calculator agent: held-out success before/after 10 min of RL (goal >= +40 points)"
GOAL_POINTS = 40.0


def run(quick: bool = False) -> Result:
    return timed_gain("configs/calculator_agent.yaml", "blackbox", 3.0 if quick else 10.0, "black-box agent",
                      GOAL_POINTS)
