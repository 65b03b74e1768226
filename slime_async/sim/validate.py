"""Validation against reality: simulate the embedded default's `async_vs_sync` runs from their measured
costs and compare with what the real runs did (wall-clock to 40 steps, staleness).

Protocol (held out, not fitted to the answer):
- engine decode curve, update pause, transport: their benchmarks (engine.json, transport.json);
- each run's episodes (turns, tokens, filtered groups) and publish time: its own summary;
- tool latency: the bench's injected lognormal (median 0.5 s, p99 10x);
- two figures the benchmarks do not give are calibrated on the two runs *without* the latency tail:
  the trainer's step time on the run's batch (on `plain-eta0`, where generation and training
  alternate) and the share of the 2 CPU cores each side keeps while both compute (on `plain-eta2`);
- the seven runs with the latency tail (eta 0, 2, 4; three seeds at 0 and 4) are then predicted.
Reality's clock is the trainer's `elapsed_s` at its 40th step (the run's `rl_s` also counts process
start-up). Each run is simulated over several seeds of the simulator and averaged.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_async.sim.cluster import Cluster, Plan, simulate
from slime_async.sim.costs import DecodeCost, IngestCost, SyncCost, TrainerCost
from slime_async.sim.fit import RESULTS_DIR, FitLine, decode_points, leave_one_out_error, load_result, workload_from_run
from slime_async.sim.workload import Lengths

CALIBRATION = ("plain-eta0-seed0", "plain-eta2-seed0")
TOLERANCE = 0.15


@dataclass
class RunCheck:
    name: str
    eta: int
    role: str
    real_s: float
    sim_s: float
    sim_spread: tuple[float, float]
    real_max_staleness: int
    sim_max_staleness: int
    real_sent: dict[int, int]
    sim_sent: dict[int, float]

    @property
    def error(self) -> float:
        return self.sim_s / self.real_s - 1


@dataclass
class Validation:
    checks: list[RunCheck]
    fit: list[FitLine]
    trainer_step_s: float
    cpu_share: float
    details: dict[str, Any] = field(default_factory=dict)

    def held_out(self) -> list[RunCheck]:
        return [c for c in self.checks if c.role == "held out"]

    def configurations(self) -> list[tuple[str, int, int, float, float]]:
        """Per (kind, eta): runs, mean real seconds, mean simulated seconds. One real run is one draw of
        the latency tail (the simulator's own seeds spread a lockstep run by +-10%), so the time goal is
        checked on the mean over a configuration's seeds."""
        out = []
        for kind in ("plain", "tail"):
            for eta in sorted({c.eta for c in self.checks}):
                group = [c for c in self.checks if c.name.startswith(kind) and c.eta == eta]
                if group:
                    out.append((kind, eta, len(group), statistics.fmean(c.real_s for c in group),
                                statistics.fmean(c.sim_s for c in group)))
        return out

    def passed(self) -> bool:
        """Every configuration's mean time within TOLERANCE, every run's max staleness the same."""
        times = all(abs(sim / real - 1) <= TOLERANCE for *_, real, sim in self.configurations())
        return times and all(c.sim_max_staleness == c.real_max_staleness for c in self.checks)


def histogram_distance(a: dict[int, float], b: dict[int, float]) -> float:
    """Total variation distance between two staleness histograms (0 same shape, 1 disjoint)."""
    ta, tb = sum(a.values()) or 1.0, sum(b.values()) or 1.0
    return 0.5 * sum(abs(a.get(k, 0) / ta - b.get(k, 0) / tb) for k in set(a) | set(b))


def _bisect(f: Callable[[float], float], lo: float, hi: float, iters: int) -> float:
    """Root of an increasing f on [lo, hi]."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def validate(results_dir: Path = RESULTS_DIR, seeds: int = 6, iters: int = 12) -> Validation:
    """Fit, calibrate on the runs without the tail, predict the runs with it (see the module docstring)."""
    bench = load_result("async_vs_sync", results_dir)
    engine = load_result("engine", results_dir)
    transport = load_result("transport", results_dir)
    details = bench["details"]
    runs: dict[str, dict[str, Any]] = details["runs"]
    steps = int(details["steps"])
    points = decode_points(engine, "tiny, concurrency")
    pause_s = next(r[2] for r in engine["rows"] if r[0] == "update pause ms" and str(r[1]).startswith("tiny")) / 1e3
    best = max(r for r in transport["rows"] if str(r[0]).startswith("zmq (this, WAL on)"))
    per_traj = 1.0 / float(best[3])  # trajectories/s of 48.9 kB frames, WAL on
    tail = Lengths.from_p99(float(details["tool_latency_median_s"]), float(details["tool_latency_p99_factor"]))
    # the embedded default: configs/local.yaml (engine.max_batch_size 64, rollout.* below)
    decode = DecodeCost(points, max_batch=64)
    ingest = IngestCost(per_trajectory_s=per_traj, latency_s=per_traj)
    fit = [
        FitLine("decode tok/s at 1..64", ", ".join(f"{b:.0f}: {r:,.0f}" for b, r in points), "engine.json (tiny, CPU)",
                f"leave-one-out {leave_one_out_error(points):.1%}"),
        FitLine("update pause", f"{pause_s * 1e3:.2f} ms", "engine.json", "measured"),
        FitLine("buffer ingest", f"{per_traj * 1e6:.0f} us / trajectory", "transport.json (WAL on)", "measured"),
        FitLine("tool latency", f"lognormal median {tail.median} s, sigma {tail.sigma:.2f}", "async_vs_sync details",
                "as injected"),
    ]

    def setup(name: str) -> tuple[Any, Plan, float]:
        run = runs[name]
        latency = tail if name.startswith("tail") else Lengths(0.0)
        workload, lines = workload_from_run(run, latency, group_size=8, max_new_tokens=48)
        if name == CALIBRATION[0] and not any(x.what.startswith(name) for x in fit):
            fit.extend(FitLine(f"{name}: {x.what}", x.value, x.source, x.error) for x in lines)
        eta = int(name.split("-eta")[1].split("-")[0])
        plan = Plan(batch_size=32, group_size=8, max_staleness=eta, steps=steps)
        return workload, plan, float(run["last"]["publish_s"])

    def run_sim(name: str, step_s: float, share: float, n: int = seeds) -> list[Any]:
        workload, plan, publish = setup(name)
        cluster = Cluster(1, decode, TrainerCost(step_s, float("inf")), SyncCost(publish, 0, 0, pause_s), ingest,
                          cpu_share=share)
        return [simulate(cluster, plan, workload, seed=s) for s in range(n)]

    def wall(name: str, step_s: float, share: float) -> float:
        return statistics.fmean(r.wall_s for r in run_sim(name, step_s, share, max(2, seeds // 2)))

    real = {name: float(run["last"]["elapsed_s"]) for name, run in runs.items()}
    step_s = _bisect(lambda s: wall(CALIBRATION[0], s, 0.5) - real[CALIBRATION[0]], 0.05, 10.0, iters)
    # more share -> faster: wall decreases, so bisect on its negative
    share = _bisect(lambda c: real[CALIBRATION[1]] - wall(CALIBRATION[1], step_s, c), 0.2, 1.0, iters)
    fit.append(FitLine("trainer step (calibrated)", f"{step_s:.3f} s",
                       f"{CALIBRATION[0]} elapsed {real[CALIBRATION[0]]:.1f} s", "fitted"))
    fit.append(FitLine("CPU share while both compute (calibrated)", f"{share:.2f}",
                       f"{CALIBRATION[1]} elapsed {real[CALIBRATION[1]]:.1f} s", "fitted"))
    checks = []
    for name, run in runs.items():
        results = run_sim(name, step_s, share)
        sent: Counter[int] = Counter()
        for r in results:
            sent.update(r.sent_staleness)
        walls = [r.wall_s for r in results]
        checks.append(RunCheck(
            name=name, eta=int(name.split("-eta")[1].split("-")[0]),
            role="calibration" if name in CALIBRATION else "held out", real_s=real[name],
            sim_s=statistics.fmean(walls), sim_spread=(min(walls), max(walls)),
            real_max_staleness=int(run["max_staleness"]), sim_max_staleness=max(r.max_staleness for r in results),
            real_sent={int(k): v for k, v in run["rollout"][0]["staleness"].items()},
            sim_sent={k: v / len(results) for k, v in sorted(sent.items())},
        ))
    return Validation(checks, fit, step_s, share)
