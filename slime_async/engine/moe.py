"""The sparse MLP of a Qwen3-MoE decoder layer over transformers' own (fused) expert parameters.

Routing follows `Qwen3MoeTopKRouter` (softmax over all experts in float32, top-k, the k weights
renormalised when `norm_topk_prob`, cast back to the hidden dtype) and the experts
`Qwen3MoeExperts` (SwiGLU; contributions summed in expert order), so the engine's logits equal
HF's. Two ways to run the experts, same values:

- `sparse`: (token, expert) rows sorted by expert, all experts' rows in two grouped matmuls
  (`moe.experts.swiglu_experts`: `torch._grouped_mm`, no loop over experts, no host sync): what
  prefill and the eager decode step use, and the fewest FLOPs;
- `dense`: every expert over every token, weighted by a [tokens, experts] matrix that is zero off
  the chosen experts: fixed shapes and no host sync, what a CUDA graph captures (`decode_static`).
  A decode step reads every expert's weights either way once the batch routes to most of them.

`sparse` has fixed shapes too (tokens x k rows; the group ends are computed on the device), so a CUDA
graph can capture it as well (`SlotModel.graph_experts`): it reads only the experts some token picked
and does k/E of `dense`'s multiply-adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from slime_async.moe.experts import can_group, group_ends, swiglu_experts
from slime_async.moe.shape import MoeShape


@dataclass(frozen=True)
class MoeMlp:
    """One layer's router and experts (the HF Parameter objects: in-place updates and device
    moves keep them valid)."""

    router: torch.Tensor
    """[experts, hidden]"""
    gate_up: torch.Tensor
    """[experts, 2 x intermediate, hidden]: each expert's gate rows, then its up rows."""
    down: torch.Tensor
    """[experts, hidden, intermediate]"""


def moe_mlp(mlp: nn.Module) -> MoeMlp:
    return MoeMlp(router=mlp.gate.weight, gate_up=mlp.experts.gate_up_proj, down=mlp.experts.down_proj)


def route(h: torch.Tensor, mlp: MoeMlp, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in h's dtype, expert ids [T, k] in descending probability) for h [T, H]."""
    probs = F.softmax(F.linear(h, mlp.router), dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, shape.top_k, dim=-1)
    if shape.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), ids


Act = Callable[[torch.Tensor], torch.Tensor]
GraphExperts = Literal["dense", "grouped"]
"""How a captured (static) decode step runs the experts: `dense`, or `sparse`'s grouped matmuls."""


def sparse(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mlp: MoeMlp, act: Act) -> torch.Tensor:
    """The experts' weighted sum for h [T, H]: the (token, expert) rows sorted by expert through two
    grouped matmuls (`moe.experts`), whatever the number of active experts, nothing read on the host."""
    k = ids.shape[1]
    order, offs = group_ends(ids.reshape(-1), mlp.gate_up.shape[0])  # token-major within each expert, as HF
    token = order // k
    out = swiglu_experts(h[token], offs, mlp.gate_up, mlp.down, act)
    out = out * weights.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add_(0, token, out)


def dense(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mlp: MoeMlp, act: Act) -> torch.Tensor:
    """The same sum with fixed shapes: every expert over every token, weighted by zero where it was
    not chosen."""
    experts = mlp.gate_up.shape[0]
    share = torch.zeros(h.shape[0], experts, dtype=h.dtype, device=h.device).scatter_(1, ids, weights)
    gate, up = torch.matmul(h, mlp.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    out = torch.matmul(act(gate) * up, mlp.down.transpose(1, 2))  # [E, T, H]
    return (out * share.T[:, :, None]).sum(dim=0)


def moe_forward(h: torch.Tensor, mlp: MoeMlp, shape: MoeShape, act: Act, static: bool,
                graph_experts: GraphExperts = "dense") -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLP's output, expert ids [..., k]) for h [..., H]. `static` (a step a CUDA graph may capture):
    `graph_experts` says how, and `grouped` falls back to `dense` where `torch._grouped_mm` cannot run
    (float32 on a GPU, say): its per-expert fallback reads the group ends on the host, which a graph
    cannot capture."""
    flat = h.reshape(-1, h.shape[-1])
    weights, ids = route(flat, mlp, shape)
    use_dense = static and (graph_experts == "dense" or not can_group(flat, mlp.gate_up.transpose(1, 2)))
    out = (dense if use_dense else sparse)(flat, weights, ids, mlp, act)
    return out.view(h.shape), ids.view(*h.shape[:-1], ids.shape[-1])
