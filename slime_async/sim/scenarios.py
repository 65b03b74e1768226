"""Studies beyond one machine: AReaL's setting and scale curves, from costs scaled off our H200 measurements.

What is measured (benchmarks/results): the embedded engine's decode curve for a 0.5B model on one H200
(engine_gpu.json, batch 1..128), Megatron train and recompute tokens/s and TFLOP/s of a 1.24B model at
8 x 4096 tokens (megatron_gpu.json), the H200's copy bandwidth and update pause, the buffer's ingest
rate with its WAL (transport.json). What is assumed, and said in docs/scaling.md: how these scale to a
1.5B model (decode step time by weight bytes plus KV reads; training by FLOPs per token), the network
(400 Gb/s per GPU), AReaL's batch and length distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from slime_async.sim.cluster import Cluster, Plan, SimResult, simulate
from slime_async.sim.costs import DecodeCost, IngestCost, SyncCost, TrainerCost
from slime_async.sim.fit import RESULTS_DIR, FitLine, decode_points, leave_one_out_error, load_result
from slime_async.sim.workload import Lengths, Workload


@dataclass(frozen=True)
class Model:
    """The shape that sets costs: parameters, layers, hidden size, KV bytes per token of context."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_bytes_per_token: float


# DeepSeek-R1-Distill-Qwen-1.5B (Qwen2.5-Math-1.5B's shape): 28 layers, hidden 1536, 2 KV heads of 128, bf16
R1_DISTILL_1_5B = Model("R1-Distill-Qwen-1.5B", 1.78e9, 28, 1536, 2 * 28 * 2 * 128 * 2)
MEASURED_ENGINE_PARAMS = 0.494e9  # the engine bench's `0.5b` preset (Qwen2-0.5B-shaped)
LINK_BPS = 50e9  # assumed: one 400 Gb/s NIC per GPU
FRAME_BYTES_PER_TOKEN = 48_900 / 4096  # transport bench: a 4,096-token trajectory is a 48.9 kB frame


@dataclass(frozen=True)
class GpuCosts:
    decode: DecodeCost
    train_tokens_per_s: float
    """One GPU, train step plus the proximal-logprob recompute, at the workload's mean sequence length."""
    copy_Bps: float
    pause_per_byte_s: float
    ingest_per_token_s: float
    fit: tuple[FitLine, ...]


def gpu_costs(model: Model, mean_context: float, mean_seq: float, max_batch: int = 256,
              results_dir: Path = RESULTS_DIR) -> GpuCosts:
    """Per-GPU costs of `model` on an H200, scaled from what this project measured there."""
    eng = load_result("engine_gpu", results_dir)
    meg = load_result("megatron_gpu", results_dir)
    tr = load_result("transport", results_dir)
    points = decode_points(eng, "0.5b, concurrency")
    scale = model.params / MEASURED_ENGINE_PARAMS  # a decode step reads every weight: time ~ weight bytes
    scaled = tuple((b, r / scale) for b, r in points)
    details = eng.get("details") if isinstance(eng.get("details"), dict) else {}
    copy_Bps = float(details.get("memcpy_GBps", 4248.0)) * 1e9  # measured with the engine bench
    kv = model.kv_bytes_per_token / copy_Bps  # reading a request's KV cache once per decode step
    decode = DecodeCost(scaled, max_batch=max_batch, kv_s_per_token_ctx=kv, mean_context=mean_context)
    steps = [r for r in meg["rows"] if r[0] == "train step" and str(r[1]).startswith("sdpa")]
    best = max(steps, key=lambda r: float(r[3]))
    tflops = float(best[3]) * 1e12
    recompute = float(str(best[7]).split()[1].replace(",", ""))
    measured_tok_s = float(best[2])
    # FLOPs per token: 6N for the dense part, 6 * layers * hidden * seq for causal attention (fwd + bwd)
    flops_tok = 6 * model.params + 6 * model.layers * model.hidden * mean_seq
    train = tflops / flops_tok
    recompute_tok_s = recompute * train / measured_tok_s  # the forward pass scales the same way
    per_gpu = 1.0 / (1.0 / train + 1.0 / recompute_tok_s)
    pause_ms = next(r[2] for r in eng["rows"] if r[0] == "update pause ms")
    pause_bytes = 1202 * 2**20  # the 0.5b case's weights
    wal = max((r for r in tr["rows"] if str(r[0]).startswith("zmq (this, WAL on)")), key=lambda r: float(r[3]))
    per_token = 1.0 / float(wal[3]) / 4096  # the 4,096-token frames, taken as proportional to tokens
    fit = (
        FitLine("H200 decode, 0.5B embedded engine", ", ".join(f"{b:.0f}: {r:,.0f}" for b, r in points),
                "engine_gpu.json", f"leave-one-out {leave_one_out_error(points):.1%}"),
        FitLine(f"decode step scaled to {model.name}", f"x{scale:.2f} time; +{kv * 1e9:.2f} ns per context token",
                "weight bytes; KV bytes / copy bandwidth", "assumed scaling"),
        FitLine("train TFLOP/s (Megatron, H200)", f"{tflops / 1e12:.0f} ({best[1]})", "megatron_gpu.json", "measured"),
        FitLine(f"train + recompute tok/s per GPU, {model.name}", f"{per_gpu:,.0f}",
                f"FLOPs/token at mean sequence {mean_seq:,.0f}", "assumed scaling"),
        FitLine("buffer ingest", f"{per_token * 1e9:.0f} ns / token", "transport.json (WAL on)",
                "proportional to bytes"),
    )
    return GpuCosts(decode, per_gpu, copy_Bps, pause_ms / 1e3 / pause_bytes, per_token, fit)


# AReaL's math setting. From the paper (arXiv 2505.24298): R1-Distill-Qwen-1.5B, 16 nodes of 8 GPUs, generation
# up to 27K tokens, 2.77x. Assumed here (our reading, not checked line by line): 3/4 of the GPUs generate,
# a batch of 512 prompts x 16 answers, no equal-rewards filter, and a length distribution: lognormal,
# median 6,000 tokens, sigma 0.8, capped at 27,648.
AREAL_GPUS = 128
AREAL_LENGTHS = Lengths(6000.0, 0.8, 27_648.0)
AREAL_WORKLOAD = Workload(prompt_tokens=200.0, completion_tokens=AREAL_LENGTHS, success_p=0.5)


def areal_cluster(gpus: int, inference_gpus: int, colocated: bool = False, model: Model = R1_DISTILL_1_5B,
                  results_dir: Path = RESULTS_DIR) -> tuple[Cluster, GpuCosts]:
    """`inference_gpus` engines of one GPU each and a trainer on the rest (or on all, colocated)."""
    mean_len = AREAL_LENGTHS.mean()
    costs = gpu_costs(model, mean_context=AREAL_WORKLOAD.prompt_tokens + mean_len / 2,
                      mean_seq=AREAL_WORKLOAD.prompt_tokens + mean_len, results_dir=results_dir)
    train_gpus = gpus if colocated else gpus - inference_gpus
    weight_bytes = 2 * model.params
    # data-parallel: the gradient all-reduce (ring, bf16) across the trainer's GPUs per step
    allreduce = 2 * (train_gpus - 1) / train_gpus * weight_bytes / LINK_BPS
    trainer = TrainerCost(fixed_s=allreduce, tokens_per_s=costs.train_tokens_per_s * train_gpus)
    # publish: broadcast over the network (engines stop while it lands), then the in-place copy
    pause = weight_bytes / LINK_BPS + weight_bytes * costs.pause_per_byte_s
    sync = SyncCost(fixed_s=weight_bytes * costs.pause_per_byte_s, bytes=weight_bytes, bandwidth_Bps=LINK_BPS,
                    pause_s=pause)
    tokens = AREAL_WORKLOAD.prompt_tokens + mean_len
    ingest = IngestCost(per_trajectory_s=tokens * costs.ingest_per_token_s, latency_s=1e-3)
    return Cluster(inference_gpus, costs.decode, trainer, sync, ingest, colocated=colocated), costs


def areal_plan(eta: int, steps: int, batch: int = 512 * 16, group: int = 16, engines: int = 96,
               max_batch: int = 256) -> Plan:
    return Plan(batch_size=batch, group_size=group, max_staleness=eta, steps=steps,
                max_concurrency=engines * max_batch, filter_equal_rewards=False)


@dataclass(frozen=True)
class Point:
    label: str
    eta: int
    gpus: int
    result: SimResult

    @property
    def step_s(self) -> float:
        """Seconds per step in steady state: over the second half of the steps (the first ones drain the
        (eta + 1) batches admitted at the start)."""
        ends = self.result.step_end_s
        k = len(ends) // 2
        return (ends[-1] - ends[k - 1]) / (len(ends) - k) if k >= 1 else ends[0]


def areal_sweep(etas: list[int], steps: int = 6, gpus: int = AREAL_GPUS, split: float = 0.75,
                batch: int = 512 * 16, seed: int = 0) -> tuple[Point, list[Point], tuple[FitLine, ...]]:
    """Synchronous colocated on all GPUs (what AReaL compares with), then eta in `etas` disaggregated."""
    cluster, costs = areal_cluster(gpus, gpus, colocated=True)
    sync = Point("sync, colocated", 0, gpus,
                 simulate(cluster, areal_plan(0, steps, batch, engines=gpus), AREAL_WORKLOAD, seed))
    engines = round(gpus * split)
    cluster, _ = areal_cluster(gpus, engines)
    points = []
    for eta in etas:
        # enough steps past the first (eta + 1) to see the steady state the bound allows
        plan = areal_plan(eta, steps + eta, batch, engines=engines)
        points.append(Point(f"async eta {eta}", eta, gpus, simulate(cluster, plan, AREAL_WORKLOAD, seed)))
    return sync, points, costs.fit


def scale_sweep(gpus_list: list[int], eta: int = 4, steps: int = 6, batch_per_gpu: int = 64,
                split: float = 0.75, max_batch_trajectories: int = 65_536, seed: int = 0) -> list[Point]:
    """Async at `eta` from 64 to 4,096 GPUs, the batch growing with the GPUs (`batch_per_gpu`, AReaL's 8,192
    at 128) up to `max_batch_trajectories` (the simulator's own time), groups of 16."""
    out = []
    for gpus in gpus_list:
        engines = max(1, round(gpus * split))
        batch = min(batch_per_gpu * gpus, max_batch_trajectories)
        batch -= batch % 16
        cluster, _ = areal_cluster(gpus, engines)
        plan = replace(areal_plan(eta, steps + eta, batch, engines=engines))
        out.append(Point(f"{gpus} GPUs", eta, gpus, simulate(cluster, plan, AREAL_WORKLOAD, seed)))
    return out
