"""guess_number (`configs/guess_number.yaml`): does RL find a better search than random guessing?

The warm-start shows two searches: a quarter of its demonstrations bisect, the rest guess at random
within the bounds that "Higher."/"Lower." leave. RL has to learn which one earns more. One run of
the real `slime-async train` for a fixed number of steps (the goal is a better search, not a speed);
the success check before and after RL plays the first `warmstart.check_tasks` held-out targets
sampled (temperature 1) and greedily. The scripted searches play the same targets through the env
itself (its reward, 2 - guesses/10 when found, and its midpoint share), so the rows compare
directly. Goal: the policy after RL, sampled, earns more than random search. The goal is judged on
the sampled policy, the one RL trains and rolls out: greedy decoding of the warm-started model
already bisects, since in the mix the midpoint is the likeliest reply in every state.
"""

from __future__ import annotations

import asyncio
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
from slime_async.evaluation.metrics import reward_metrics
from slime_async.types import Message, Task

DESCRIPTION = "guess_number: mean guesses and reward before/after async RL vs random search and bisection"
CONFIG = "configs/guess_number.yaml"


async def play(args: GuessArgs, target: int, replies: list[str]) -> GuessNumberEnv:
    """A scripted game through the env's own feedback and scoring."""
    env = GuessNumberEnv(args)
    env.task = Task(id="scripted", prompt=GuessNumberEnv.question(args.high), answer=target)
    for reply in replies:
        if await env.on_reply(Message(role="assistant", content=reply)) is None:
            break
    return env


def scripted_rows(num_tasks: int) -> tuple[list[list[Any]], float]:
    """Random search, bisection and the demonstrations' mix on the held-out targets; random's mean reward."""
    cfg = load_config(Path(__file__).resolve().parents[1] / CONFIG)
    args = msgspec.convert(cfg.env.args, GuessArgs)
    tasks = GuessNumberEnv.tasks(args, "eval")[:num_tasks]
    turns = args.limits.max_turns
    searches = {
        "random search": [random_search_replies(int(t.answer), args.high, random.Random(i), turns)
                          for i, t in enumerate(tasks)],
        "bisection": [binary_search_replies(int(t.answer), args.high) for t in tasks],
        f"the demonstrations ({args.demo_bisection:.0%} bisect)": [
            GuessNumberEnv.demonstration(args, t) for t in tasks],
    }
    async def play_all(games: list[list[str]]) -> list[GuessNumberEnv]:
        return [await play(args, int(t.answer), g) for t, g in zip(tasks, games, strict=True)]

    rows = []
    for name, games in searches.items():
        envs = asyncio.run(play_all(games))
        # scored as the eval scores the model's games (one sample a game: pass@1 is the share solved)
        scores = reward_metrics([[e.win()] for e in envs], [1])
        rows.append([name, statistics.mean(e.found() for e in envs), statistics.mean(e.num_guesses() for e in envs),
                     scores["mean_reward"], scores["pass@1"], statistics.mean(e.midpoint_share() for e in envs)])
    return rows, rows[0][3]


def model_row(name: str, metrics: dict[str, float]) -> list[Any]:
    return [name, metrics["metric/found"], metrics["metric/num_guesses"], metrics["mean_reward"],
            metrics["pass@1"], metrics["metric/midpoint_share"]]


def run(quick: bool = False) -> Result:
    steps = 10 if quick else 200  # about 5.6 s a step on 2 cores; the held-out eval levels off from step 150
    with tempfile.TemporaryDirectory(prefix="bench-guess-") as tmp:
        s = run_training(CONFIG, "guess", Path(tmp), [f"train.steps={steps}"])
    before, after = s["success_before"], s["success_after"]
    rows, random_reward = scripted_rows(before["tasks"])
    for when, res in (("before RL", before), (f"after {s['steps']} steps of RL", after)):
        for mode in ("sampled", "greedy"):
            rows.append(model_row(f"model {when}, {mode}", res[f"{mode}_metrics"]))
    sampled = [res["sampled_metrics"]["mean_reward"] for res in (before, after)]
    greedy = [res["greedy_metrics"]["mean_reward"] for res in (before, after)]
    return Result(
        columns=["policy", "found", "mean guesses", "mean reward", "found in <= 10", "midpoint share"],
        rows=rows,
        headline=(f"guess_number held-out mean reward of the sampled policy: {sampled[0]:.3f} before RL, "
                  f"{sampled[1]:.3f} after {s['steps']} steps (greedy {greedy[0]:.3f} -> {greedy[1]:.3f}); "
                  f"random search {random_reward:.3f} (goal: above it; "
                  f"{'met' if sampled[1] > random_reward else 'not met'})"),
        details={"run": {k: v for k, v in s.items() if k != "records"} | {"curve": [
            (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]}, "steps": s["steps"]},
    )
