"""The engine benchmark on one CUDA GPU: a Qwen2-0.5B-shaped random model in bf16 (issue 3's GPU table)."""

from __future__ import annotations

import torch

from benchmarks import Result
from benchmarks.engine import measure

DESCRIPTION = "embedded engine on a CUDA GPU: 0.5B Qwen2-shaped model, bf16, decode tok/s and update pause"


def run(quick: bool = False) -> Result:
    if not torch.cuda.is_available():
        raise SystemExit("engine_gpu needs a CUDA GPU; on CPU run `slime-async bench engine`")
    concurrencies = (1, 32) if quick else (1, 8, 32, 64, 128)
    return measure("0.5b", "cuda", "bfloat16", concurrencies, ("0.5b",), repeats=3 if quick else 7,
                   rounds=2 if quick else 3)
