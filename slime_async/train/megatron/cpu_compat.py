"""The one place where megatron-core is helped to run without a GPU (CI: CPU, gloo, world size 1).

megatron-core 0.16 asks `torch.cuda.current_device()` for the device of tensors it makes on the
way (RoPE frequencies, layer weights); on a build of torch without CUDA that call raises. Inside
`cpu_megatron()` it answers "cpu" instead. That is the only shim: the rest of what assumes CUDA
is kept off the CPU path by design, not patched:
- attention is `sdpa_attention.SDPACoreAttention` (Megatron's unfused attention forks the CUDA RNG
  tracker and builds its causal mask on "cuda");
- the optimizer is torch's AdamW with our own clipping (`optimizer.TorchOptimizer`): Megatron's
  optimizers and gradient clipping allocate on "cuda" and check `torch.cuda.*Tensor` types;
- the micro-batch loop is ours (Megatron's schedules count tokens on "cuda"), so pipeline
  parallelism needs a GPU.

The backend enters `cpu_megatron()` around its calls into megatron-core only when no GPU is
present; with a GPU nothing here is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def cpu_megatron(active: bool = True) -> Iterator[None]:
    """While inside, `torch.cuda.current_device()` returns "cpu" (when `active`; else a no-op)."""
    if not active:
        yield
        return
    with mock.patch.object(torch.cuda, "current_device", _cpu_device):
        yield


def _cpu_device() -> str:
    return "cpu"
