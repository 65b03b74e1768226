"""The whole asynchronous loop on one GPU (issue 37), against lockstep and against the bound.

For each model shape (Qwen2.5-0.5B's and 1.5B's, random weights made on the GPU, the calculator's
tokenizer): `slime-async train configs/e2e_gpu.yaml` (a warm-start on the GPU, then the Megatron
trainer and the embedded engine with CUDA graphs on the same GPU, weights pushed in place each step)
at eta 2 (with held-out success before and after: the learning figure), 0 (lockstep: generate, then
train, as slime's and verl's colocated modes do), 1 and 4, each to the same number of steps. Then the
engine alone on the warm-started weights, driven by `slime-async rollout` at hand-set concurrencies
and with adaptive concurrency: the standalone generation rate and the adaptive comparison.

Figures, per run, over its steady steps (after the first `WARMUP` steps, which pay for compiling):
- trained samples/s and tokens/s; generated episodes/s and tokens/s (the rollout worker's books, over
  its whole life: its start and the trainer's first steps included, so below the steady rate);
- the trainer's time split (waiting for data, building the batch, recomputing logprobs, training,
  publishing) from its metrics; GPU busy share from `nvidia-smi` sampled every 250 ms;
- memory of each part (engine, trainer) from `nvidia-smi --query-compute-apps`.
The bound is the slower of generation and training at their standalone rates in trained samples per
second: generation alone (the engine alone, best hand-set concurrency) times the run's kept fraction
(groups of equal rewards are dropped), and training alone as the lockstep run's own training phase
(batch + recompute + train + publish while the engine has nothing to do).

Parts to run (a device call lasts at most 10 minutes: one shape's runs take two, on the same warm
machine, which keeps the model and its cached warm-start under `E2E_GPU_DIR`): `E2E_GPU_SHAPES`
(default `0.5b,1.5b`), `E2E_GPU_ETAS` (default `2,0,1,4`; eta 2 must come first, it warm-starts),
`E2E_GPU_GENERATION` (`1`: the engine-alone rows, the default; with `E2E_GPU_ETAS=` alone, on a
warm-start found in the cache or made first), steps per run `E2E_GPU_STEPS`
(default 24) and `E2E_GPU_OVERRIDES` (config overrides of every run, space-separated, e.g. a smaller
`train.micro_batch_size` for the 1.5B shape). Whatever is not run this time is kept from
`benchmarks/results/e2e_gpu.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks import RESULTS_DIR, Result
from benchmarks._engine_alone import generation_alone, warm_started
from benchmarks._runs import run_training

DESCRIPTION = ("the whole loop on one GPU (0.5B/1.5B shapes, Megatron trainer + embedded CUDA-graph engine): "
               "async/lockstep, throughput/bound, held-out success before/after, adaptive concurrency "
               "(goal: async faster than lockstep, +40 points for 0.5B)")
CONFIG = "configs/e2e_gpu.yaml"
WARMUP = 3
"""Steps left out of the steady-state figures (the first compiles the fused logprob kernel)."""
ETAS = (2, 0, 1, 4)
"""eta 2 first: it pays for the warm-start (cached for the others) and measures success before/after."""
CONCURRENCY = (32, 64, 128, 256)
"""Hand-set `rollout.max_concurrency` values of the generation-alone rows."""
GOAL_POINTS = 40
OVERRIDES = os.environ.get("E2E_GPU_OVERRIDES", "").split()


def run(quick: bool = False) -> Result:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench e2e_gpu needs a CUDA GPU (the device machine); nothing was run")
    shapes = os.environ.get("E2E_GPU_SHAPES", "0.5b" if quick else "0.5b,1.5b").split(",")
    steps = int(os.environ.get("E2E_GPU_STEPS", "10" if quick else "24"))
    etas = [int(x) for x in os.environ.get("E2E_GPU_ETAS", ",".join(map(str, ETAS))).split(",") if x]
    generation = os.environ.get("E2E_GPU_GENERATION", "1") == "1"
    work = Path(os.environ.get("E2E_GPU_DIR", Path(tempfile.gettempdir()) / "bench-e2e-gpu"))
    out = RESULTS_DIR / "e2e_gpu.json"
    details: dict[str, Any] = json.loads(out.read_text())["details"] if out.exists() else {}
    details.setdefault("shapes", {})
    details["device"] = torch.cuda.get_device_name()

    def save(shape: str, part: dict[str, Any]) -> None:
        """After each run: what was measured so far survives a device call cut off at its time limit."""
        details["shapes"][shape] = part
        out.write_text(json.dumps({"benchmark": "e2e_gpu", "partial": True, "details": details}, indent=2) + "\n")

    for shape in shapes:
        found = details["shapes"].get(shape, {})
        details["shapes"][shape] = measure_shape(shape, steps, work, torch.cuda.get_device_name(), etas, generation,
                                                 found.get("runs", {}), found.get("generation_alone"),
                                                 lambda part, shape=shape: save(shape, part))
    rows = [row for shape in details["shapes"].values() for row in shape["rows"]]
    return Result(
        columns=["shape", "run", "steps", "s (steady)", "samples/s", "gen tok/s", "wait", "train", "publish",
                 "GPU busy", "vs lockstep", "of bound"],
        rows=rows, headline=headline(details), details=details)


def measure_shape(shape: str, steps: int, tmp: Path, device: str, etas: list[int], with_generation: bool,
                  runs: dict[str, dict[str, Any]], generation: list[dict[str, Any]] | None,
                  save: Callable[[dict[str, Any]], None] = lambda part: None) -> dict[str, Any]:
    """The `etas` runs and (`with_generation`) the engine-alone rows of one shape, added to `runs` and
    `generation` (an earlier call's); `save` gets the figures so far after each run."""
    from slime_async.models.tiny_model import PRESETS, make_model

    began = time.monotonic()
    model = tmp / f"model-{shape}"
    if not (model / "config.json").is_file():  # an earlier call on this machine made it
        make_model(model, PRESETS[shape], device="cuda")
        import torch

        torch.cuda.empty_cache()  # this process holds no GPU memory beside the runs (7.3 GB for 1.5B otherwise)
    made_s = time.monotonic() - began
    failed: dict[str, str] = {}
    for eta in etas:
        name = f"{shape}-eta{eta}"
        check = ["warmstart.check_tasks=256"] if eta == 2 else ["warmstart.check_tasks=0", "warmstart.min_success=0"]
        with sampling_gpu() as smi:
            try:
                s = run_training(CONFIG, name, tmp, [f"model.path={model}", f"rollout.max_staleness={eta}",
                                                     f"train.steps={steps}", "data.eval_every=0", *check, *OVERRIDES])
            except RuntimeError as exc:  # a run that failed (out of memory, say): its end is kept, the others run
                failed[name] = str(exc)[-3000:]
                print(f"  {name} failed:\n{failed[name]}", flush=True)
                save(summarise(shape, runs, generation or [], made_s, device) | {"failed": failed})
                continue
        runs[name] = analyse(s, smi.samples, smi.memory) | {"eta": eta, "warmstart": s["warmstart"]}
        if eta == 2:
            runs[name]["success_before"] = s["success_before"]["sampled"]
            runs[name]["success_after"] = s["success_after"]["sampled"]
        save(summarise(shape, runs, generation or [], made_s, device) | {"failed": failed})
    if with_generation:  # on the warm-started weights: a run's, or (an earlier call's, gone) made now
        warm = next((Path(r["warmstart"]["path"]) for r in reversed(runs.values())
                     if Path(r["warmstart"]["path"]).is_dir()), None) or warm_started(model, CONFIG, OVERRIDES)
        (tmp / f"gen-{shape}").mkdir(parents=True, exist_ok=True)
        commit = os.environ.get("SLIME_ASYNC_BENCH_COMMIT")  # these rows may be of a later call than the runs
        generation = [row | {"commit": commit} for row in generation_alone(warm, tmp / f"gen-{shape}", CONFIG,
                                                                    concurrencies=CONCURRENCY)]
    return summarise(shape, runs, generation or [], made_s, device) | {"failed": failed}


# --- one training run ------------------------------------------------------------------------------


def analyse(summary: dict[str, Any], smi: list[tuple[float, float, float]], memory: dict[int, float]
            ) -> dict[str, Any]:
    """Steady-state figures of one `train` run from its step records, its rollout books and the GPU samples."""
    records = summary["records"]
    steady = records[WARMUP:] if len(records) > WARMUP + 1 else records
    t0 = steady[0]["time"] - steady[0]["seconds"]  # the first steady step's start
    t1 = steady[-1]["time"]
    span = max(t1 - t0, 1e-9)
    trained = sum(r["trajectories"] for r in steady)
    tokens = sum(r.get("tokens", 0) for r in steady)
    split = {k: sum(r.get(k) or 0.0 for r in steady) for k in ("wait_s", "batch_s", "recompute_s", "train_s",
                                                                "publish_s")}
    rollout = summary["rollout"][0] if summary.get("rollout") else {}
    kept = rollout.get("sent", 0) / max(rollout.get("episodes", 0), 1)
    busy = [u for t, u, _ in smi if t0 <= t <= t1]
    parts = {name: int(pid.split()[-1]) for name, pid in summary.get("parts", {}).items() if pid.startswith("pid")}
    return {
        "steps": len(records), "steady_steps": len(steady), "steady_s": span, "samples_per_s": trained / span,
        "trained_tokens_per_s": tokens / span, "split_s": split,
        "generated_tokens_per_s": rollout.get("tokens_per_s"), "episodes_per_s": rollout.get("episodes_per_s"),
        "kept_fraction": kept, "gpu_busy": statistics.fmean(busy) / 100 if busy else None,
        "gpu_samples": len(busy), "max_staleness": summary.get("max_staleness"),
        "memory_gib": {name: memory.get(pid) for name, pid in parts.items() if memory.get(pid)},
        "gpu_memory_peak_gib": max((m for _, _, m in smi), default=None),
        "rl_s": summary["rl_s"], "wall_s": summary["wall_s"],
    }


class GpuSampler:
    """`nvidia-smi` in the background: (unix time, utilization %, GiB used) every 250 ms, and the
    largest GPU memory each process held (GiB), sampled every 2 s."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.memory: dict[int, float] = {}
        self._procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        util = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used",
                                 "--format=csv,noheader,nounits", "-lms", "250"], stdout=subprocess.PIPE, text=True)
        self._procs.append(util)
        self._threads = [threading.Thread(target=self._read, args=(util,), daemon=True),
                         threading.Thread(target=self._apps, daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.terminate()
            p.wait(timeout=10)
        for t in self._threads:
            t.join(timeout=10)

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sample = parse_smi_line(line)
            if sample is not None:
                self.samples.append(sample)

    def _apps(self) -> None:
        while not self._stop.wait(2.0):  # a sampling period
            done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True)
            for pid, mib in parse_apps(done.stdout).items():
                self.memory[pid] = max(self.memory.get(pid, 0.0), mib / 1024)


def parse_smi_line(line: str) -> tuple[float, float, float] | None:
    """`2026/12/06 06:20:11.123, 37, 55756` -> (unix time, 37.0, GiB used); None for anything else."""
    try:
        stamp, util, used = (x.strip() for x in line.split(","))
        when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return when, float(util), float(used) / 1024
    except ValueError:
        return None


def parse_apps(text: str) -> dict[int, float]:
    """`--query-compute-apps=pid,used_memory` lines -> {pid: MiB}."""
    out = {}
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = (x.strip() for x in line.split(","))
            out[int(pid)] = float(mib)
    return out


@contextlib.contextmanager
def sampling_gpu() -> Iterator[GpuSampler]:
    sampler = GpuSampler()
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()


# --- figures ---------------------------------------------------------------------------------------


def summarise(shape: str, runs: dict[str, dict[str, Any]], generation: list[dict[str, Any]], made_s: float,
              device: str) -> dict[str, Any]:
    """Rows and ratios of one shape from what has been run of it (a part not run yet leaves its ratios None)."""
    lockstep = runs.get(f"{shape}-eta0")
    hand = [g for g in generation if g["concurrency"] != "adaptive"]
    best = max(hand, key=lambda g: g["episodes_per_s"]) if hand else None
    adaptive = next((g for g in generation if g["concurrency"] == "adaptive"), None)
    train_alone = None
    if lockstep is not None:  # training alone: the lockstep run's training phase, the engine having nothing to do
        ls = lockstep["split_s"]
        train_alone = lockstep["samples_per_s"] * lockstep["steady_s"] / max(
            ls["batch_s"] + ls["recompute_s"] + ls["train_s"] + ls["publish_s"], 1e-9)
    rows = []
    for r in sorted(runs.values(), key=lambda r: r["eta"]):
        limits = [x for x in (best and best["episodes_per_s"] * r["kept_fraction"], train_alone) if x]
        r["bound_samples_per_s"] = min(limits) if best and train_alone else None
        r["of_bound"] = r["samples_per_s"] / r["bound_samples_per_s"] if r["bound_samples_per_s"] else None
        r["vs_lockstep"] = r["samples_per_s"] / lockstep["samples_per_s"] if lockstep else None
        total = max(sum(r["split_s"].values()), 1e-9)
        rows.append([shape, f"eta {r['eta']}" + (" (lockstep)" if r["eta"] == 0 else ""), r["steps"], r["steady_s"],
                     r["samples_per_s"], r["generated_tokens_per_s"], r["split_s"]["wait_s"] / total,
                     (r["split_s"]["train_s"] + r["split_s"]["recompute_s"]) / total, r["split_s"]["publish_s"] / total,
                     _or_dash(r["gpu_busy"]), _or_dash(r["vs_lockstep"]), _or_dash(r["of_bound"])])
    for g in generation:
        rows.append([shape, f"generation alone, concurrency {g['concurrency']}", "-", g["seconds"], "-",
                     g["tokens_per_s"], "-", "-", "-", "-", "-", g["episodes_per_s"] / best["episodes_per_s"]
                     if best else "-"])
    return {"device": device, "commit": os.environ.get("SLIME_ASYNC_BENCH_COMMIT"), "model_made_s": made_s,
            "runs": runs, "generation_alone": generation,
            "train_alone_samples_per_s": train_alone, "best_hand_set": best and best["concurrency"],
            "adaptive_vs_best": adaptive["episodes_per_s"] / best["episodes_per_s"] if adaptive and best else None,
            "rows": rows}


def _or_dash(x: float | None) -> float | str:
    return "-" if x is None else x


def _ratio(runs: dict[str, dict[str, Any]], shape: str, eta: int, key: str = "vs_lockstep") -> str:
    x = runs.get(f"{shape}-eta{eta}", {}).get(key)
    return "not run" if x is None else f"{x:.2f}x" if key == "vs_lockstep" else f"{x:.0%}"


def headline(details: dict[str, Any]) -> str:
    parts = []
    for shape, d in details["shapes"].items():
        runs = d["runs"]
        line = (f"{shape}: async/lockstep {_ratio(runs, shape, 2)} at eta 2 (eta 1 {_ratio(runs, shape, 1)}, "
                f"eta 4 {_ratio(runs, shape, 4)}), throughput/bound {_ratio(runs, shape, 2, 'of_bound')}")
        async2 = runs.get(f"{shape}-eta2", {})
        if "success_after" in async2:
            gain = 100 * (async2["success_after"] - async2["success_before"])
            goal = f" (goal +{GOAL_POINTS})" if shape == "0.5b" else ""
            line += (f", held-out {async2['success_before']:.1%} -> {async2['success_after']:.1%} "
                     f"({gain:+.1f} points{goal})")
        if d["adaptive_vs_best"] is not None:
            line += f", adaptive concurrency {d['adaptive_vs_best']:.2f}x the best hand-set ({d['best_hand_set']})"
        if d.get("failed"):
            line += f", failed: {', '.join(d['failed'])}"
        parts.append(line)
    return f"on {details['device']}: " + "; ".join(parts)


if __name__ == "__main__":  # `python -m benchmarks.e2e_gpu` on the device machine
    from benchmarks import run_benchmark

    run_benchmark("e2e_gpu", quick="--quick" in sys.argv)
