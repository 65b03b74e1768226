"""guess_number (`configs/guess_number.yaml`): does RL find a better search than the demonstrations'?

The warm-start shows random guesses within the bounds that "Higher."/"Lower." leave; bisection
would do better. One run of the real `slime-async train` for a fixed number of steps (the goal is a
better search, not a speed); the success check before and after RL plays the first
`warmstart.check_tasks` held-out targets sampled (temperature 1) and greedily. The two
scripted searches are scored on the same targets with the env's own reward (2 - guesses/10 when
found), so the rows compare directly. Goal: the policy after RL earns more than random search.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import Result
from benchmarks._runs import run_training
from envs.guess_number import GuessArgs, GuessNumberEnv, binary_search_replies, random_search_replies
from slime_async.config import load_config

DESCRIPTION = "guess_number: mean guesses and reward before/after async RL vs random search and bisection"
CONFIG = "configs/guess_number.yaml"


def scripted_rows(num_tasks: int) -> tuple[list[list[Any]], float]:
    """Random search (the demonstrations' policy) and bisection on the held-out targets; random's mean reward."""
    cfg = load_config(Path(__file__).resolve().parents[1] / CONFIG)
    args = msgspec.convert(cfg.env.args, GuessArgs)
    targets = [int(t.answer) for t in GuessNumberEnv.tasks(args, "eval")[:num_tasks]]
    turns = args.limits.max_turns
    searches = {
        "random search (the demonstrations)": [
            random_search_replies(t, args.high, random.Random(i), turns) for i, t in enumerate(targets)],
        "bisection": [binary_search_replies(t, args.high) for t in targets],
    }
    rows = []
    for name, games in searches.items():
        guesses = [len(g) for g in games]
        rows.append([name, 1.0, statistics.mean(guesses), statistics.mean(2.0 - g / 10 for g in guesses),
                     sum(g <= 10 for g in guesses) / len(guesses)])
    return rows, rows[0][3]


def model_row(name: str, metrics: dict[str, float]) -> list[Any]:
    return [name, metrics["metric/found"], metrics["metric/num_guesses"], metrics["mean_reward"],
            metrics["pass@1"]]


def run(quick: bool = False) -> Result:
    steps = 10 if quick else 60  # about 9 s a step on 2 cores (episodes of 7 turns or more)
    with tempfile.TemporaryDirectory(prefix="bench-guess-") as tmp:
        s = run_training(CONFIG, "guess", Path(tmp), [f"train.steps={steps}"])
    before, after = s["success_before"], s["success_after"]
    rows, random_reward = scripted_rows(before["tasks"])
    for when, res in (("before RL", before), (f"after {s['steps']} steps of RL", after)):
        for mode in ("sampled", "greedy"):
            rows.append(model_row(f"model {when}, {mode}", res[f"{mode}_metrics"]))
    best = max(after["sampled_metrics"]["mean_reward"], after["greedy_metrics"]["mean_reward"])
    return Result(
        columns=["policy", "found", "mean guesses", "mean reward", "found in <= 10"],
        rows=rows,
        headline=(f"guess_number held-out mean reward after {s['steps']} steps of RL: "
                  f"{after['sampled_metrics']['mean_reward']:.3f} sampled, {after['greedy_metrics']['mean_reward']:.3f}"
                  f" greedy, vs random search {random_reward:.3f} (goal: above it; "
                  f"{'met' if best > random_reward else 'not met'})"),
        details={"run": {k: v for k, v in s.items() if k != "records"} | {"curve": [
            (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]}, "steps": s["steps"]},
    )
