"""The HF <-> Megatron-core mapping of a Qwen2/Qwen3/Llama/Qwen3-MoE model's weights: names and layouts.

Pure functions of whole ("full") tensors; no megatron import, no process groups. A Megatron
parameter's full tensor is the concatenation of its tensor-parallel shards along `Slot.partition_dim`
(rank r holds `full.chunk(tp, dim)[r]`), so splitting and gathering are uniform; the layouts are:
- `linear_qkv`: per query group g, the rows of g's query heads, then g's key head, then g's value
  head (Megatron splits the fused projection per group, so every shard holds whole groups, or a
  contiguous part of one group when tensor parallelism exceeds the key/value heads);
- `linear_fc1`: per tensor-parallel rank r, [gate rows of r; up rows of r] (each rank's SwiGLU
  splits its own shard in two), so this layout depends on the tensor-parallel size;
- embedding and output rows: the HF rows, then zero rows up to the padded vocabulary;
- everything else: the HF tensor as it is.
Layer numbers in Megatron names here are global (the model's `layer_number - 1`), not per stage.

Mixture of experts (named as Megatron's `SequentialMLP` names them, one MLP per expert; our grouped
experts hold them stacked and `train.megatron.weights.global_names` shows one view per expert under
these names): the router
`decoder.layers.N.mlp.router.weight` is HF's `model.layers.N.mlp.gate.weight` [experts, hidden];
expert E's `decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight` is [gate; up] of HF's
`model.layers.N.mlp.experts.E.{gate,up}_proj.weight` (the dense fc1 layout) and its `linear_fc2` is
`down_proj`. E here is the global expert index: a rank of expert parallelism holds experts
`ep_rank * local + i` as its `local_experts.i` (the weights module renames them; see
`weights.global_names`). Experts are never split by tensor parallelism (the backend runs Megatron's
expert tensor parallel size 1), so their fc1 is [gate; up] whole (`gate_up`) whatever the size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["copy", "qkv", "fc1", "gate_up", "vocab"]


@dataclass(frozen=True)
class Geometry:
    """What the layouts depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tensor_parallel: int
    tied_embeddings: bool
    num_experts: int = 0
    """Experts per layer of a MoE model (0: dense)."""


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter: the HF tensors it is made of and how."""

    hf_names: tuple[str, ...]
    kind: Kind
    partition_dim: int | None
    """Dimension split over tensor-parallel ranks; None: every rank holds all of it."""


# per-layer Megatron suffix -> (HF suffixes under model.layers.N., kind, partition dim); TE's fused
# layer-norm names map to the same HF tensors as the local spec's separate norms
_LAYER: dict[str, tuple[tuple[str, ...], Kind, int | None]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy", None),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "copy", None),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", 0),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy", None),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy", None),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy", 1),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy", None),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "copy", None),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1", 0),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy", 1),
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MOE: dict[str, tuple[tuple[str, ...], Kind, int | None]] = {
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "gate_up", None),
    "linear_fc2.weight": (("down_proj.weight",), "copy", None),
}
EXPERT_NAME = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
"""A Megatron expert parameter's name: (prefix, expert index, suffix)."""


def slot(name: str, geo: Geometry) -> Slot:
    """The slot of Megatron parameter `name` (global layer numbers); KeyError for unknown names."""
    if (m := _LAYER_NAME.match(name)) and m.group(2) in _LAYER:
        hf, kind, dim = _LAYER[m.group(2)]
        return Slot(tuple(f"model.layers.{m.group(1)}.{h}" for h in hf), kind, dim)
    if m and geo.num_experts and m.group(2) == "mlp.router.weight":  # MoE names only in a MoE geometry
        return Slot((f"model.layers.{m.group(1)}.mlp.gate.weight",), "copy", None)
    expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", m.group(2)) if m and geo.num_experts else None
    if m and expert and expert.group(2) in _MOE:
        hf, kind, dim = _MOE[expert.group(2)]
        return Slot(tuple(f"model.layers.{m.group(1)}.mlp.experts.{expert.group(1)}.{h}" for h in hf), kind, dim)
    if name == "embedding.word_embeddings.weight":
        return Slot(("model.embed_tokens.weight",), "vocab", 0)
    if name == "output_layer.weight":  # with tied embeddings, the last stage's copy of the embedding
        return Slot(("model.embed_tokens.weight" if geo.tied_embeddings else "lm_head.weight",), "vocab", 0)
    if name == "decoder.final_layernorm.weight":
        return Slot(("model.norm.weight",), "copy", None)
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


def exported(name: str, geo: Geometry) -> bool:
    """Whether `name` is exported: a tied output layer is the embedding, exported once under its name."""
    return not (geo.tied_embeddings and name == "output_layer.weight")


def to_megatron(s: Slot, hf: list[torch.Tensor], geo: Geometry) -> torch.Tensor:
    """The full Megatron tensor of slot `s` from its HF tensors (in `s.hf_names` order)."""
    if s.kind == "copy":
        return hf[0]
    if s.kind == "vocab":
        (w,) = hf
        pad = w.new_zeros((geo.padded_vocab_size - w.shape[0], *w.shape[1:]))
        return torch.cat([w, pad])
    if s.kind == "qkv":
        q, k, v = hf
        g, d = geo.num_kv_heads, geo.head_dim
        tail = q.shape[1:]  # (hidden,) for weights, () for biases
        per_group = [q.reshape(g, (geo.num_heads // g) * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)]
        return torch.cat(per_group, dim=1).reshape(-1, *tail)
    if s.kind in ("fc1", "gate_up"):
        gate, up = hf
        tp = geo.tensor_parallel if s.kind == "fc1" else 1
        return torch.cat([t for r in zip(gate.chunk(tp), up.chunk(tp), strict=True) for t in r])
    raise ValueError(s.kind)


def to_hf(s: Slot, full: torch.Tensor, geo: Geometry) -> list[torch.Tensor]:
    """The inverse of `to_megatron`: the HF tensors (in `s.hf_names` order) of a full Megatron tensor."""
    if s.kind == "copy":
        return [full]
    if s.kind == "vocab":
        return [full[: geo.vocab_size]]
    if s.kind == "qkv":
        g, d = geo.num_kv_heads, geo.head_dim
        hq = (geo.num_heads // g) * d
        tail = full.shape[1:]
        q, k, v = full.reshape(g, hq + 2 * d, *tail).split([hq, d, d], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]
    if s.kind in ("fc1", "gate_up"):
        halves = [c.chunk(2) for c in full.chunk(geo.tensor_parallel if s.kind == "fc1" else 1)]
        if len(halves) == 1:  # no tensor parallelism: gate and up are views (no copy of the largest weights)
            return list(halves[0])
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(s.kind)


def shard(full: torch.Tensor, s: Slot, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of a full tensor."""
    return full if s.partition_dim is None else full.chunk(tp, dim=s.partition_dim)[rank]


def unshard(shards: list[torch.Tensor], s: Slot) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's part, in rank order."""
    return shards[0] if s.partition_dim is None else torch.cat(shards, dim=s.partition_dim)
