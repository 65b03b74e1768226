"""The one place where megatron-core is helped to run without a GPU (CI: CPU, gloo, world size 1).

megatron-core 0.16 asks `torch.cuda.current_device()` for the device of tensors it makes on the
way (RoPE frequencies, layer weights); on a build of torch without CUDA that call raises. Inside
`cpu_megatron()` it answers "cpu" instead. The MoE all-to-all token dispatcher copies its token
counts to the host on a side CUDA stream (`torch.cuda.Stream`, `current_stream`, `stream`, an event
it synchronises on); inside `cpu_megatron()` those are one host "stream" whose waits do nothing, as
the counts are on the host already; and the dispatcher's "move to the host" helper, which turns
the all-to-all split sizes into host arrays only when they are on a GPU, does so for CPU tensors too
(gloo's all-to-all takes split sizes as a sequence, not a tensor). Under sequence parallelism (MoE
with tensor parallelism) the embedding forks Megatron's CUDA RNG tracker around its dropout: inside
`cpu_megatron()` the tracker's fork does nothing (every dropout here is 0; no random number is drawn).
Those are the only shims: the rest of what assumes CUDA is kept off the CPU path by design, not patched:
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
from typing import Any
from unittest import mock

import torch


@contextlib.contextmanager
def cpu_megatron(active: bool = True) -> Iterator[None]:
    """While inside, `torch.cuda.current_device()` returns "cpu" (when `active`; else a no-op)."""
    if not active:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", _cpu_device))
        for name, value in (("Stream", _host_stream), ("current_stream", _host_stream),
                            ("stream", _no_stream)):
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        from megatron.core import tensor_parallel
        from megatron.core.transformer.moe import token_dispatcher

        stack.enter_context(mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host))
        stack.enter_context(mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", _no_rng_tracker))
        yield


def _cpu_device() -> str:
    return "cpu"


class _HostStream:
    """The one "stream" of a CPU: everything on it has already happened."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


_HOST = _HostStream()


def _host_stream(*args: object, **kwargs: object) -> _HostStream:
    return _HOST


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` for tensors already on the host: numpy when asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _no_stream(stream: object) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class _NoRngTracker:
    """Megatron's CUDA RNG tracker where nothing draws random numbers: forking it changes nothing."""

    def fork(self, name: str = "") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _no_rng_tracker() -> _NoRngTracker:
    return _NoRngTracker()
