"""The anchor and the breakdown of `megatron_gpu` (issue 30).

- The anchor: what a user gets from twenty lines of plain Hugging Face code on the same GPU, shape and
  batch: `Qwen2ForCausalLM` with bf16 weights and SDPA, torch's fused AdamW, `loss.backward()` per
  micro-batch, and the same per-token work at the head as the RL objective (log-softmax in float32,
  the target's logprob, a masked sum). The Megatron backend exists to beat it.
- The breakdown: one train step under torch's profiler, its GPU kernel time grouped by what the
  kernels do (matmuls, attention, norms, the logprob path, optimizer, copies, ...) and the time the
  GPU waited on the host (step wall time minus kernel time).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CATEGORIES = [  # first match wins: kernel names of cuBLAS/CUTLASS, flash attention, torch's own kernels
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_xmma|cublas|wgmma|splitk"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norm", r"rms|layer_?norm|norm_kernel"),
    ("logprob", r"log_softmax|logsumexp|softmax|gather|scatter|nll|cross_entropy"),
    ("reduction", r"reduce_kernel|sum_kernel|norm_two|max_kernel"),
    ("copy/cast", r"memcpy|memset|copy|cast|to_copy|convert|fill"),
    ("elementwise", r"elementwise|vectorized|silu|swiglu|mul|add|div|exp|where|unrolled"),
]


def hf_step_times(model_dir: Path, batch: Any, micros: list[int], steps: int, device: str = "cuda"
                  ) -> dict[int, dict[str, float]]:
    """Median seconds of one plain HF train step over `batch`, by micro-batch size (after a warm-up)."""
    out: dict[int, dict[str, float]] = {}
    for micro in micros:
        try:
            seconds = _median_seconds(hf_step(model_dir, batch, micro, device), steps, device)
        except torch.OutOfMemoryError:
            out[micro] = {"oom": 1.0}
            _release(device)
            continue
        peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
        out[micro] = {"step_s": seconds, "peak_gb": peak}
        _release(device)
    return out


def hf_step(model_dir: Path, batch: Any, micro: int, device: str = "cuda") -> Callable[[], None]:
    """The plain HF train step over `batch` in micro-batches of `micro` (its model and optimizer live
    as long as the returned function)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    ids = batch.input_ids.to(device)
    mask = batch.loss_mask.to(device)[:, 1:].float()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for s in range(0, ids.shape[0], micro):
            x = ids[s : s + micro]
            logits = model(input_ids=x).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, x[:, 1:, None])[..., 0]
            loss = -(logp * mask[s : s + micro]).sum() / mask.sum()
            loss.backward()
        optimizer.step()

    return step


def kernel_breakdown(step: Callable[[], None], device: str = "cuda", top: int = 12) -> dict[str, Any]:
    """One call of `step` (after a warm-up) under torch's profiler: GPU time by category, the top
    kernels, and the GPU's idle time (wall minus kernel time: host syncs, launches)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        step()
        _sync(device)
        wall = time.perf_counter() - began
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / 1e6
    total = sum(kernels.values())
    by_category: dict[str, float] = {}
    for name, seconds in kernels.items():
        category = next((c for c, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE)), "other")
        by_category[category] = by_category.get(category, 0.0) + seconds
    return {
        "wall_s": wall, "kernel_s": total, "idle_s": max(0.0, wall - total),
        "by_category_s": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_s": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top]),
    }


def profile_note(prof: dict[str, Any]) -> str:
    """A `kernel_breakdown` in a bench table's note: the GPU's idle ms, then each category's ms."""
    parts = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in prof["by_category_s"].items())
    return f"idle {1e3 * prof['idle_s']:.0f}; {parts}"


def _median_seconds(step: Callable[[], None], steps: int, device: str) -> float:
    times = []
    for i in range(steps + 1):
        _sync(device)
        began = time.perf_counter()
        step()
        _sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
