"""Adaptive concurrency against hand-set `rollout.max_concurrency` values, on CPU (issue 37, item 4).

The embedded default's engine alone (`configs/local.yaml`: the tiny model warm-started, one embedded
engine of 64 slots, CPU), driven by `slime-async rollout` at each hand-set number of episodes in flight
and then with `rollout.adaptive_concurrency: true` (its ceiling the largest hand-set value), in two
settings: the calculator's instant tool, where the engine is the only wait, and the same tool with a
long-tailed latency injected (lognormal, median 0.5 s, p99 5 s, as `bench async_vs_sync`), where
episodes spend most of their time in the tool and many more must be in flight to keep the engine busy.
The best hand-set value differs between the two by design: that is what a hand-set value gets wrong.

Figures per row: episodes/s and generated tokens/s over the row's whole rollout (the engine is started
once per setting, and a first uncounted rollout pays one-time costs); for the adaptive row, the median
and last limit it chose. Headline: adaptive / best hand-set episodes/s in each setting, against the goal
that the rule needs no hand-set value to come within 10% of the best one. `bench e2e_gpu` runs the same
rows on the GPU (its engine-alone rows).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks import Result
from benchmarks._engine_alone import generation_alone, warm_started

DESCRIPTION = ("adaptive concurrency vs hand-set rollout.max_concurrency, engine alone, tiny model on CPU, instant and "
               "long-tail tools (goal: adaptive >= 0.9x the best hand-set episodes/s in both)")
CONFIG = "configs/local.yaml"
GOAL = 0.9
SETTINGS: dict[str, list[str]] = {
    "instant tools": [],
    "long-tail tools": ["env.args.tool_latency_s=0.5", "env.args.tool_latency_p99=10"],  # median 0.5 s, p99 5 s
}
CONCURRENCY = (8, 16, 32, 64, 128, 256)


def run(quick: bool = False) -> Result:
    from slime_async.models.tiny_model import cached_model_dir

    # 8 episodes a group: 2,048 a row, 8x the largest number in flight, so that the drain at the end (the last
    # episodes wait out the tool's tail with the engine nearly idle) is a small part of each row
    groups = 8 if quick else 256
    concurrencies = (8, 32) if quick else CONCURRENCY
    warm = warm_started(cached_model_dir("tiny"), CONFIG, [])
    settings: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        for i, (name, overrides) in enumerate(SETTINGS.items()):
            print(f"{name}:", flush=True)
            found = generation_alone(warm, Path(tmp) / str(i), CONFIG, groups, concurrencies, overrides)
            settings[name] = summarise(found)
            rows += [[name, r["concurrency"], r["episodes"], r["seconds"], r["episodes_per_s"], r["tokens_per_s"],
                      r["episodes_per_s"] / settings[name]["best_episodes_per_s"],
                      "-" if r["concurrency"] != "adaptive" else f"{r['limit_median']:.0f} / {r['limit_last']}"]
                     for r in found]
    details = {"settings": settings, "groups_per_row": groups, "config": CONFIG, "goal": GOAL}
    return Result(columns=["setting", "concurrency", "episodes", "s", "episodes/s", "tokens/s", "vs best hand-set",
                           "adaptive limit (median / last)"],
                  rows=rows, headline=headline(settings), details=details)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's rows, its best hand-set value and the adaptive row's ratio to it."""
    hand = [r for r in rows if r["concurrency"] != "adaptive"]
    adaptive = next(r for r in rows if r["concurrency"] == "adaptive")
    best = max(hand, key=lambda r: r["episodes_per_s"])
    return {"rows": rows, "best_hand_set": best["concurrency"], "best_episodes_per_s": best["episodes_per_s"],
            "adaptive_vs_best": adaptive["episodes_per_s"] / best["episodes_per_s"],
            "adaptive_limit_median": adaptive["limit_median"]}


def headline(settings: dict[str, Any]) -> str:
    ratios = ", ".join(f"{d['adaptive_vs_best']:.2f} with {name} (best hand-set {d['best_hand_set']})"
                       for name, d in settings.items())
    met = all(d["adaptive_vs_best"] >= GOAL for d in settings.values())
    return f"adaptive / best hand-set episodes/s: {ratios} (goal {GOAL}, {'met' if met else 'not met'})"
