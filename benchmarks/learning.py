"""Learning: the embedded default (`configs/local.yaml`) before and after a fixed budget of RL.

Each seed runs the real `slime-async train` (warm-start, success check, fully asynchronous RL for
`train.time_limit_s` seconds, success after) and reads its `summary.json`; the held-out success
during RL comes from the evaluation worker's rounds (`eval.jsonl`), timed from the first trainer
step. The warm-start is shared by the seeds (`warmstart.seed`), so the seeds differ in RL only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import crossing_s, run_training

DESCRIPTION = "embedded default: held-out success before/after 8 min of async RL, 3 seeds (goal >= 85% sampled)"
GOAL = 0.85
OVERRIDES_OF = "configs/local.yaml"
"""The config it trains; its overrides (`slime-async bench learning train.loss=sapo`) go to every seed's run."""


def run(quick: bool = False, overrides: list[str] | None = None) -> Result:
    return learning(OVERRIDES_OF, GOAL, quick, overrides=overrides)


def learning(config: str, goal: float, quick: bool, what: str = "", overrides: list[str] | None = None) -> Result:
    """`config` from its warm-start through 8 minutes of RL (2 in `quick`), 3 seeds (1 in `quick`);
    `overrides` come after the benchmark's own settings (so they win)."""
    overrides = list(overrides or [])
    if overrides:
        what = f"{what}with {' '.join(overrides)}: "
    seeds = [0] if quick else [0, 1, 2]
    minutes = 2.0 if quick else 8.0
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        for seed in seeds:
            s = run_training(config, f"learning-seed{seed}", Path(tmp), [
                f"run.seed={seed}", "warmstart.seed=0", f"train.time_limit_s={minutes * 60}", "train.steps=100000",
                *overrides])
            before, after = s["success_before"], s["success_after"]
            crossed = crossing_s(s, "eval/held_out/pass@1", goal)
            rows.append([seed, before["sampled"], before["greedy"], after["sampled"], after["greedy"], s["steps"],
                         s["rl_s"], crossed if crossed is not None else "-"])
            runs.append({k: v for k, v in s.items() if k != "records"} | {"curve": [
                (r["version"], r["time"], r.get("reward_mean")) for r in s["records"]]})
    after_sampled = [r[3] for r in rows]
    budget = f"{minutes:.0f} min of RL"
    if any(o.startswith(("train.steps=", "train.time_limit_s=")) for o in overrides):  # the budget is theirs
        budget = f"{sum(r[5] for r in rows) / len(rows):.0f} steps of RL ({sum(r[6] for r in rows) / len(rows):.0f} s)"
    mean = sum(after_sampled) / len(after_sampled)
    return Result(
        columns=["seed", "before sampled", "before greedy", "after sampled", "after greedy", "steps", "RL s",
                 f"s to {goal:.0%} (eval)"],
        rows=rows,
        headline=f"{what}held-out sampled success after {budget}: {mean:.1%} mean of {len(seeds)} seeds "
                 f"(goal {goal:.0%})",
        details={"runs": runs, "tasks": rows and runs[0]["success_after"]["tasks"], "overrides": overrides},
    )
