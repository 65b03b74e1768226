"""Fully asynchronous (eta = 2, the default; and 4) against synchronous lockstep (eta = 0) on the same budget of steps.

Both run the embedded default from the same warm-start, to the same number of optimizer steps, with
and without a long-tailed tool latency injected into the calculator (lognormal, p99 = 10x the
median). Lockstep waits for the slowest episode of every batch and leaves generation idle while it
trains; the asynchronous run admits new episodes as soon as the staleness budget allows, so a slow
episode holds only its own slot, and a larger eta lets more episodes wait at once. The rows without
injected latency show the part of the speed-up that comes from overlapping generation with training
alone (on 2 cores both share the CPU). Lockstep and eta 4 with the tail, the pair that decides the
goal, run on 3 seeds (`run.seed`; one shared warm-start), the other rows on seed 0.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = ("async (eta=2, 4) vs sync (eta=0): wall-clock to the same steps, long-tail tool latency, eta 4 over 3 "
               "seeds (goal >= 2.5x, success within 2 points)")
GOAL = 2.5


def run(quick: bool = False) -> Result:
    # 40 steps: at 20 the policy is still climbing, and one run's final success differs from the
    # next by more than the 2 points the goal allows (20-step runs: +6.2 points at eta 4)
    steps = 10 if quick else 40
    # eta 0 and eta 4 with the tail, the pair that decides the goal, on 3 seeds: one seed's final
    # success moves by a few points from run to run (-2.5 and +6.2 points at eta 4 in single runs)
    seeds = [0] if quick else [0, 1, 2]
    latency = 0.5  # median seconds per tool call; p99 5 s
    plan = [("plain", 0, 0), ("plain", 2, 0), ("tail", 0, 0), ("tail", 2, 0), ("tail", 4, 0)]
    plan += [("tail", eta, seed) for seed in seeds[1:] for eta in (0, 4)]
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for kind, eta, seed in plan:
            name = f"{kind}-eta{eta}-seed{seed}"
            extra = [f"env.args.tool_latency_s={latency}"] if kind == "tail" else []
            # one warm-start (warmstart.seed) for every run: the seeds differ in RL only
            s = run_training("configs/local.yaml", name, Path(tmp), [
                f"run.seed={seed}", "warmstart.seed=0", f"rollout.max_staleness={eta}", f"train.steps={steps}",
                "data.eval_every=0", *extra])
            runs[name] = {k: v for k, v in s.items() if k != "records"}
            rows.append([kind, eta, seed, s["steps"], s["rl_s"], s["success_after"]["sampled"],
                         s["success_after"]["greedy"], s["max_staleness"]])
    by = {(r[0], r[1], r[2]): r for r in rows}
    for r in rows:
        r.append(by[(r[0], 0, r[2])][4] / r[4])  # speed-up over lockstep of the same kind and seed
    speedup2 = by[("tail", 2, 0)][8]
    plain = by[("plain", 2, 0)][8]
    speedups4 = [by[("tail", 4, seed)][8] for seed in seeds]
    gap2 = by[("tail", 2, 0)][5] - by[("tail", 0, 0)][5]
    gaps4 = [by[("tail", 4, seed)][5] - by[("tail", 0, seed)][5] for seed in seeds]
    sync = [by[("tail", 0, seed)][5] for seed in seeds]
    async4 = [by[("tail", 4, seed)][5] for seed in seeds]
    gap4 = statistics.fmean(gaps4)
    return Result(
        columns=["run", "eta", "seed", "steps", "RL s", "success sampled", "success greedy", "max staleness",
                 "speed-up vs eta 0"],
        rows=rows,
        headline=f"async/sync wall-clock speed-up with long-tail tools: {statistics.fmean(speedups4):.2f}x at eta 4 "
                 f"(mean of {len(seeds)} seeds, {min(speedups4):.2f}-{max(speedups4):.2f}; goal {GOAL}x), "
                 f"{speedup2:.2f}x at eta 2 (without the tail {plain:.2f}x); final sampled success async - sync at "
                 f"eta 4: {100 * gap4:+.1f} points, mean of {len(seeds)} seeds "
                 f"({', '.join(f'{100 * g:+.1f}' for g in gaps4)}; goal within 2 points), at eta 2 {100 * gap2:+.1f}",
        details={"runs": runs, "steps": steps, "seeds": seeds, "tool_latency_median_s": latency,
                 "tool_latency_p99_factor": 10,
                 "eta4": {"speedups": speedups4, "success_gaps": gaps4, "success_sync": sync, "success_async": async4,
                          "success_gap_mean": gap4,
                          "success_gap_sem": statistics.stdev(gaps4) / len(gaps4) ** 0.5 if len(gaps4) > 1 else None}},
    )
