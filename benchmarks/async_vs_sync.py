"""Fully asynchronous (eta = 2, the default; and 4) against synchronous lockstep (eta = 0) on the same budget of steps.

Both run the embedded default from the same warm-start, to the same number of optimizer steps, with
and without a long-tailed tool latency injected into the calculator (lognormal, p99 = 10x the
median). Lockstep waits for the slowest episode of every batch and leaves generation idle while it
trains; the asynchronous run admits new episodes as soon as the staleness budget allows, so a slow
episode holds only its own slot, and a larger eta lets more episodes wait at once. The rows without
injected latency show the part of the speed-up that comes from overlapping generation with training
alone (on 2 cores both share the CPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = "async (eta=2, 4) vs sync (eta=0): wall-clock to the same steps, long-tail tool latency (goal >= 2.5x)"
GOAL = 2.5


def run(quick: bool = False) -> Result:
    # 40 steps: at 20 the policy is still climbing, and one run's final success differs from the
    # next by more than the 2 points the goal allows (20-step runs: +6.2 points at eta 4)
    steps = 10 if quick else 40
    latency = 0.5  # median seconds per tool call; p99 5 s
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        # eta 4 too, with the tail: more episodes in flight hide more of it (the staleness sweep
        # finds no loss of success up to eta 8 on this task)
        for tail, etas in ((False, (0, 2)), (True, (0, 2, 4))):
            for eta in etas:
                name = f"{'tail' if tail else 'plain'}-eta{eta}"
                extra = [f"env.args.tool_latency_s={latency}"] if tail else []
                s = run_training("configs/local.yaml", name, Path(tmp), [
                    f"rollout.max_staleness={eta}", f"train.steps={steps}", "data.eval_every=0", *extra])
                runs[name] = {k: v for k, v in s.items() if k != "records"}
                rows.append([name, eta, "lognormal" if tail else "none", s["steps"], s["rl_s"],
                             s["success_after"]["sampled"], s["success_after"]["greedy"], s["max_staleness"]])
    by = {r[0]: r for r in rows}
    speedup = by["tail-eta0"][4] / by["tail-eta2"][4]
    speedup4 = by["tail-eta0"][4] / by["tail-eta4"][4]
    plain = by["plain-eta0"][4] / by["plain-eta2"][4]
    gap = by["tail-eta2"][5] - by["tail-eta0"][5]
    gap4 = by["tail-eta4"][5] - by["tail-eta0"][5]
    for r in rows:
        r.append(by[f"{r[0].split('-')[0]}-eta0"][4] / r[4])
    return Result(
        columns=["run", "eta", "tool latency", "steps", "RL s", "success sampled", "success greedy", "max staleness",
                 "speed-up vs eta 0"],
        rows=rows,
        headline=f"async/sync wall-clock speed-up with long-tail tools: {speedup:.2f}x at eta 2, {speedup4:.2f}x at "
                 f"eta 4 (goal {GOAL}x; without the tail {plain:.2f}x at eta 2); final sampled success async - sync: "
                 f"{gap:+.1%} at eta 2, {gap4:+.1%} at eta 4 (goal within 2 points)",
        details={"runs": runs, "steps": steps, "tool_latency_median_s": latency, "tool_latency_p99_factor": 10},
    )
