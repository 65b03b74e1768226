"""Experts as grouped matrix products: one kernel for all experts of a layer, not a Python loop over them.

Shared by the Megatron backend's experts (`train/megatron/grouped_experts.py`) and the embedded
engine's sparse MoE step (`engine/moe.py`); transformers' own Qwen3-MoE experts do the same
(`experts_implementation="grouped_mm"`, its default), which is what the torch backend runs.

Rows arrive sorted by expert; `offs` [experts] int32 holds, on the rows' device, where each expert's
rows end (the cumulative counts), so nothing waits for the host. `torch._grouped_mm` multiplies each
group of rows by its expert's matrix in one launch (CUTLASS on a Hopper GPU; a CPU kernel in recent
torch). Where it cannot run (torch without it, a dtype or device it refuses, strides that are not
multiples of 16 bytes) `grouped_mm` falls back to one `torch.mm` per expert over the same weights:
the same values (the fallback reads the group ends on the host), only slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

Act = Callable[[torch.Tensor], torch.Tensor]


@functools.cache
def _probe(device: str, dtype: torch.dtype, k: int, n: int) -> bool:
    """Does `torch._grouped_mm` run forward and backward on `device` in `dtype` for [rows, k] @ [k, n]
    with the right-hand matrices stored transposed (as expert weights [experts, n, k] are)?"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # whatever mode the first caller is in (the engine runs under inference mode)
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros(16, k, dtype=dtype, device=device, requires_grad=True)
            w = torch.zeros(2, n, k, dtype=dtype, device=device, requires_grad=True)
            offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def can_group(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w, ...)` runs `torch._grouped_mm` (else the per-expert fallback). Its CUDA
    kernel also wants both tensors to start at a 16-byte boundary (a weight inside a flat buffer may not)."""
    return (x.dtype == w.dtype and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and _probe(str(x.device), x.dtype, w.shape[-2], w.shape[-1]))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[rows, n]: rows of group g (those before `offs[g]`, after `offs[g - 1]`) times `w[g]` [k, n], for
    x [rows, k] sorted by group and w [groups, k, n]; rows past `offs[-1]` are left unspecified."""
    if can_group(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return looped_mm(x, w, offs)


def looped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as one matmul per group (the fallback; reads `offs` on the host)."""
    ends = offs.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(x[start:end] @ w[g])
        start = end
    parts.append(x.new_zeros(x.shape[0] - start, w.shape[-1]))
    return torch.cat(parts)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) for expert ids [N] (flat): `order` sorts the N entries by expert, token order kept
    within an expert; `counts` [experts] int32 the entries per expert, both on `ids`' device (a scatter,
    not `bincount`, whose output size waits for the device)."""
    order = ids.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return order, counts


def group_ends(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offs): `sort_by_expert`'s order, and `offs` [experts] int32 the cumulative counts."""
    order, counts = sort_by_expert(ids, num_experts)
    return order, counts.cumsum(0, dtype=torch.int32)


def swiglu_experts(rows: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row through its expert's SwiGLU MLP: down_e(act(gate_e x) * up_e x) for rows [N, hidden]
    sorted by expert with group ends `offs`; gate_up [experts, 2 x inter, hidden] (each expert's gate
    rows, then its up rows: HF's `gate_up_proj`, Megatron's whole-expert fc1) and down [experts, hidden,
    inter]. `scale` [N], when given, multiplies each row's activation before the down projection (cast
    back to the rows' dtype), as Megatron's expert MLP applies the routing weights."""
    gate, up = grouped_mm(rows, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    inner = act(gate) * up
    if scale is not None:
        inner = (inner * scale[:, None]).to(rows.dtype)
    return grouped_mm(inner, down.transpose(1, 2), offs)
