"""Trainer: weight publish time by mode against the copy bound, and trainer tokens/s on CPU.

Publishing: a real `slime-async serve` process per model; `sync.WeightPublisher` pushes the whole
model (`tensor` mode in one bucket and in 64 MB buckets, `disk` mode) and the wall time of a publish
(serialise, transfer, the engine's decode and copy, the version answer) is compared with the copy
bound: the weights' bytes ÷ this machine's measured memcpy bandwidth, i.e. the time one in-memory
copy of the weights takes. Training: the torch backend's recompute (no grad) and train step
(forward, backward, AdamW) on batches of trajectories, in tokens per second; with a GPU, also the
step time of a Qwen2-0.5B-shaped model in bf16 (`gpu_train`).
"""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import Result
from slime_async.config.schema import SyncConfig, TrainConfig
from slime_async.models.tiny_model import cached_model_dir
from slime_async.sync import WeightPublisher
from slime_async.train.batch import build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend
from slime_async.types import Trajectory

DESCRIPTION = "weight publish time by mode vs the copy bound; trainer tokens/s on CPU"


def memcpy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of one large tensor copy (best of `repeats`)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


class _Server:
    def __init__(self, model_dir: Path, timeout: float = 300.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(model_dir), "--port", "0",
             "--device", "cpu", "--max-batch-size", "2", "--context-length", "256"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()
        self.url = ""
        self.log: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if (m := re.search(r"serving on (http://\S+)", line)) and not self.url:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("engine did not start:\n" + "".join(self.log[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _publish_times(url: str, backend: TorchBackend, cfg: SyncConfig, repeats: int, disk_dir: Path
                         ) -> tuple[list[float], list[float], int, int]:
    times, prepare = [], []
    async with WeightPublisher([url], cfg, disk_dir=disk_dir) as pub:
        nbytes = buckets = 0
        for v in range(1, repeats + 2):
            report = await pub.publish(backend.named_weights, v)
            if report.failed:
                raise RuntimeError(f"publish failed: {report.failed}")
            if v > 1:  # the first publish warms caches and connections
                times.append(report.seconds)
                prepare.append(report.prepare_seconds)
            nbytes, buckets = report.bytes, report.buckets
    return times, prepare, nbytes, buckets


def _trajectories(n: int, tokens: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    return make_trajectories(n, group_size=4, seed=seed, vocab=vocab, tokens=tokens, logprob=-5.0, reward_levels=2)


def _train_rate(backend: TorchBackend, n: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(recompute tokens/s, train-step tokens/s), median over `repeats` after one warm-up."""
    batch = build_batch(_trajectories(n, tokens, backend.vocab_size), max_seq_len=tokens).batch
    assert batch is not None
    obj = Objective(TrainConfig(loss="grpo"))
    fwd, step = [], []
    for i in range(repeats + 1):
        t = time.perf_counter()
        prox = backend.logprobs(batch, 1.0).logprobs
        t1 = time.perf_counter()
        result = backend.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0)
        t2 = time.perf_counter()
        assert result.applied
        if i:
            fwd.append(t1 - t)
            step.append(t2 - t1)
    return batch.num_tokens / statistics.median(fwd), batch.num_tokens / statistics.median(step)


def gpu_train(preset: str = "0.5b", n: int = 8, tokens: int = 2048, micro: int = 4, repeats: int = 3
              ) -> dict[str, Any]:
    """The torch backend on one GPU, bf16: step time and tokens/s for a `preset`-shaped model."""
    backend = TorchBackend(cached_model_dir(preset), device="cuda", dtype="bfloat16", micro_batch_size=micro)
    params = sum(p.numel() for _, p in backend.named_weights())
    batch = build_batch(_trajectories(n, tokens, backend.vocab_size), max_seq_len=tokens).batch
    assert batch is not None
    obj = Objective(TrainConfig(loss="grpo"))
    fwd, step = [], []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        prox = backend.logprobs(batch, 1.0).logprobs
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        result = backend.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert result.applied
        if i:
            fwd.append(t1 - t)
            step.append(t2 - t1)
    step_s = statistics.median(step)
    return {
        "preset": preset, "params": params, "sequences": n, "tokens_per_sequence": tokens, "micro_batch": micro,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "recompute_s": statistics.median(fwd), "train_step_s": step_s,
        "train_step_tok_s": batch.num_tokens / step_s, "recompute_tok_s": batch.num_tokens / statistics.median(fwd),
        # 6 N per token for forward + backward, attention excluded: a lower bound of the work done
        "model_tflops": 6 * params * batch.num_tokens / step_s / 1e12,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
    }


def run(quick: bool = False) -> Result:
    torch.manual_seed(0)
    bandwidth = memcpy_bandwidth()
    presets = ["tiny"] if quick else ["tiny", "100m"]
    repeats = 2 if quick else 3
    rows: list[list[Any]] = []
    details: dict[str, Any] = {"memcpy_GBps": bandwidth / 1e9, "publish": {}, "train": {}}
    headline_ratio = {}
    for preset in presets:
        model_dir = cached_model_dir(preset)
        backend = TorchBackend(model_dir, device="cpu", micro_batch_size=4)
        params = sum(p.numel() for _, p in backend.named_weights())
        server = _Server(model_dir)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                modes = [("tensor", 512.0), ("tensor", 64.0), ("disk", 512.0)]
                if quick:
                    modes = [("tensor", 512.0), ("disk", 512.0)]
                for mode, bucket in modes:
                    cfg = SyncConfig(mode=mode, bucket_mb=bucket)  # type: ignore[arg-type]
                    times, prepare, nbytes, buckets = asyncio.run(
                        _publish_times(server.url, backend, cfg, repeats, Path(tmp)))
                    seconds = statistics.median(times)
                    bound = nbytes / bandwidth
                    rows.append([preset, nbytes / 2**20, f"{mode} ≤{bucket:g} MB", buckets, seconds * 1e3,
                                 statistics.median(prepare) * 1e3, bound * 1e3, seconds / bound, ""])
                    details["publish"][f"{preset}/{mode}/{bucket:g}"] = {
                        "seconds": times, "trainer_side_seconds": prepare, "bytes": nbytes, "buckets": buckets,
                        "copy_bound_s": bound, "params": params}
                    if mode == "tensor" and bucket == 512.0:
                        headline_ratio[preset] = seconds / bound
        finally:
            server.stop()
        n, tokens = (8, 128) if preset == "tiny" else (4, 128)
        if quick:
            n, tokens = 4, 64
        fwd_rate, step_rate = _train_rate(backend, n, tokens, repeats=1 if quick or preset != "tiny" else 3)
        details["train"][preset] = {"sequences": n, "tokens_per_sequence": tokens,
                                    "recompute_tok_s": fwd_rate, "train_step_tok_s": step_rate}
        rows.append([preset, "", f"recompute {n}x{tokens}", "", "", "", "", "", fwd_rate])
        rows.append([preset, "", f"train step {n}x{tokens}", "", "", "", "", "", step_rate])
        del backend
    if torch.cuda.is_available() and not quick:
        gpu = gpu_train()
        details["gpu"] = gpu
        rows.append([f"{gpu['preset']} (GPU bf16)", "", f"train step {gpu['sequences']}x{gpu['tokens_per_sequence']}",
                     "", gpu["train_step_s"] * 1e3, "", "", "", gpu["train_step_tok_s"]])
    biggest = presets[-1]
    headline = (f"tensor-mode publish of the {biggest} model: {headline_ratio[biggest]:.1f}x the copy bound "
                f"(memcpy {bandwidth / 1e9:.1f} GB/s); train step {details['train'][biggest]['train_step_tok_s']:,.0f}"
                f" tok/s on CPU")
    return Result(
        columns=["model", "MiB", "what", "buckets", "ms", "trainer-side ms", "copy bound ms", "x bound",
                 "tok/s"],
        rows=rows,
        headline=headline,
        details=details,
    )
