"""`slime-async simulate CONFIG`: one simulated run of a config, its fitted costs printed first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slime_async.sim.cluster import Cluster, Plan, simulate
from slime_async.sim.costs import TrainerCost
from slime_async.sim.fit import FitLine, read_run_dir, workload_from_run
from slime_async.sim.scenarios import AREAL_WORKLOAD, areal_cluster
from slime_async.sim.workload import Lengths, Workload


def plan_from_config(cfg: Any, steps: int | None) -> Plan:
    """The scheduling settings of a loaded config (`rollout.*`, `buffer.policy`, `train.steps`)."""
    r = cfg.rollout
    return Plan(batch_size=r.batch_size, group_size=r.group_size, max_staleness=r.max_staleness,
                steps=steps or cfg.train.steps, max_concurrency=r.max_concurrency, policy=cfg.buffer.policy,
                filter_equal_rewards=r.filter_equal_rewards)


def run_simulate(cfg: Any, console: Console, *, hardware: str, gpus_inference: int | None, gpus_train: int | None,
                 steps: int | None, run_dir: Path | None, tool_latency_s: float, tool_p99: float,
                 seed: int = 0) -> dict[str, Any]:
    """Build the cluster and workload, simulate, print the fit and the outcome; returns the summary."""
    plan = plan_from_config(cfg, steps)
    fit: list[FitLine] = []
    latency = Lengths.from_p99(tool_latency_s, tool_p99) if tool_latency_s > 0 else Lengths(0.0)
    workload: Workload
    if hardware == "cpu":
        from slime_async.sim.validate import validate

        v = validate(seeds=2, iters=10)  # the CPU machine's costs, calibrated as the validation does
        fit += v.fit
        from slime_async.sim.validate import RESULTS_DIR, load_result

        runs = load_result("async_vs_sync", RESULTS_DIR)["details"]["runs"]
        summary = read_run_dir(run_dir) if run_dir else runs["plain-eta0-seed0"]
        workload, lines = workload_from_run(summary, latency, plan.group_size, cfg.rollout.sampling.max_new_tokens)
        fit += lines
        from slime_async.sim.costs import DecodeCost, IngestCost, SyncCost
        from slime_async.sim.fit import decode_points

        points = decode_points(load_result("engine", RESULTS_DIR), "tiny, concurrency")
        engines = gpus_inference or cfg.engine.num_engines
        cluster = Cluster(engines, DecodeCost(points, max_batch=cfg.engine.max_batch_size),
                          TrainerCost(v.trainer_step_s, float("inf")), SyncCost(0.09, 0, 0, 1e-3),
                          IngestCost(1 / 2809, 1 / 2809), cpu_share=v.cpu_share)
    elif hardware == "h200":
        inference = gpus_inference or 96
        train = gpus_train or 32
        cluster, costs = areal_cluster(inference + train, inference)
        fit += costs.fit
        if run_dir:
            workload, lines = workload_from_run(read_run_dir(run_dir), latency, plan.group_size,
                                                cfg.rollout.sampling.max_new_tokens)
            fit += lines
        else:
            workload = AREAL_WORKLOAD
            fit.append(FitLine("episode lengths", "lognormal median 6,000, sigma 0.8, cap 27,648", "AReaL's setting",
                               "assumed"))
    else:
        raise ValueError(f"--hardware: expected cpu or h200, got {hardware!r}")
    table = Table("fitted", "value", "from", "error", title="cost models")
    for line in fit:
        table.add_row(line.what, line.value, line.source, line.error)
    console.print(table)
    result = simulate(cluster, plan, workload, seed)
    s = result.summary()
    out = Table("measure", "value", title=f"simulated: {cluster.num_engines} engines, eta {plan.max_staleness}, "
                                         f"batch {plan.batch_size}, {plan.steps} steps")
    out.add_row("wall-clock to the last step", f"{result.wall_s:,.1f} s")
    out.add_row("seconds / step (mean)", f"{result.wall_s / result.steps:,.2f}")
    out.add_row("trained trajectories / s", f"{result.buffer['trained'] / result.wall_s:,.1f}")
    out.add_row("max staleness at training", str(result.max_staleness))
    out.add_row("staleness histogram (trained)", str(s["train_staleness"]))
    out.add_row("dropped stale", str(result.buffer["dropped_stale"]))
    out.add_row("utilisation", ", ".join(f"{k} {x:.0%}" for k, x in result.utilisation.items()))
    out.add_row("first bottleneck", result.bottleneck())
    out.add_row("simulator", f"{result.episodes:,} episodes, {result.events:,} events, {result.cpu_s:.2f} s")
    console.print(out)
    return s
