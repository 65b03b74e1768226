"""LoRA for the megatron backend: one adapter per HF module, inside Megatron's fused linear layers.

Megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`; peft, SGLang and vLLM expect an
adapter per HF module (`q_proj`, `gate_proj`, ...). So each fused layer carries one A/B pair per HF
module it holds (`MegatronLora`, registered as the layer's `lora` submodule), and the outputs of the
pairs are placed in the layer's fused layout (`sync.megatron_names`): per query group [q; k; v] rows,
per tensor-parallel rank [gate; up] rows. A module left out of `train.lora.target_modules` adds
nothing to its rows. The update is added to the frozen layer's output by a forward hook, so the
base layer, its parameter names and its weight conversion stay as they are; `weights.global_names`
skips the adapters.

Tensor parallelism (same arithmetic as the base layers):
- column-parallel layers (`linear_qkv`, `linear_fc1`): A whole on every rank, B split over its output
  rows like the weight. The rank-r part of A x goes through Megatron's copy-to-region (identity
  forward, all-reduce backward), so A's gradient is the whole sum on every rank;
- row-parallel layers (`linear_proj` = o_proj, `linear_fc2` = down_proj): A split over its input
  columns like the weight, the partial A x all-reduced over tensor-parallel ranks, then B, whole.
The split parameters are flagged `tensor_model_parallel` (their gradient-norm share is counted on
every rank, the whole ones on rank 0 only).

Not done (refused by the backend): pipeline parallelism, MoE models, Transformer Engine layers (their
norm is fused into linear_qkv/linear_fc1, so their input is not the normalised one the adapters
need), and tensor parallelism beyond the key/value heads (a rank would hold part of a query group).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from slime_async.sync import megatron_names as names
from slime_async.train.megatron.parallel import Layout

FUSED: dict[str, tuple[tuple[str, ...], Literal["column", "row"], str]] = {
    # Megatron layer (under decoder.layers.N.) -> (its HF modules in layout order, parallelism, HF parent)
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column", "self_attn"),
    "self_attention.linear_proj": (("o_proj",), "row", "self_attn"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column", "mlp"),
    "mlp.linear_fc2": (("down_proj",), "row", "mlp"),
}
ADAPTABLE = [m for members, _, _ in FUSED.values() for m in members]


def check_targets(targets: list[str]) -> None:
    """A ValueError naming `train.lora.target_modules` when it names what this backend cannot adapt."""
    unknown = [t for t in targets if t not in ADAPTABLE]
    if unknown or not targets:
        raise ValueError(f"train.lora.target_modules: the megatron backend adapts {ADAPTABLE}; {unknown or targets} "
                         "is not among them")


def module_sizes(geo: names.Geometry, hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each HF module, whole."""
    q, kv = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}


class MegatronLora(nn.Module):
    """The adapters of one Megatron linear layer: an A/B pair per targeted HF module, this rank's part."""

    def __init__(self, fused: str, targets: list[str], sizes: dict[str, tuple[int, int]], rank: int, alpha: float,
                 geo: names.Geometry, layout: Layout, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.members, self.kind, _ = FUSED[fused]
        self.targets = [m for m in self.members if m in targets]
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.geo, self.layout = geo, layout
        self.sizes = {m: sizes[m] for m in self.members}
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        tp = layout.tp
        for m in self.targets:
            n_in, n_out = sizes[m]
            a = torch.empty(rank, n_in, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as the torch backend (nn.Linear, peft) initialises A
            if dist.is_initialized() and dist.get_world_size() > 1:  # every rank the same whole A
                dist.broadcast(a, src=0)
            if self.kind == "row":
                a = a.chunk(tp, dim=1)[layout.tp_rank]
            self.lora_A[m] = nn.Parameter(a.contiguous())
            self.lora_B[m] = nn.Parameter(torch.zeros(n_out // tp if self.kind == "column" else n_out, rank,
                                                      device=device, dtype=dtype))
            split = self.lora_B[m] if self.kind == "column" else self.lora_A[m]
            split.tensor_model_parallel = True  # type: ignore[attr-defined]
            split.partition_dim = 0 if self.kind == "column" else 1  # type: ignore[attr-defined]
            split.partition_stride = 1  # type: ignore[attr-defined]

    # --- forward --------------------------------------------------------------------------

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The update to the layer's (local) output for its input x [s, b, in / tp or in]."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        tp = self.layout.tp
        outs: dict[str, torch.Tensor] = {}
        for m in self.targets:
            h = x @ self.lora_A[m].T.to(x.dtype)
            if tp > 1:
                h = (copy_to_tensor_model_parallel_region(h, group=self.layout.tp_group) if self.kind == "column"
                     else reduce_from_tensor_model_parallel_region(h, group=self.layout.tp_group))
            outs[m] = (h @ self.lora_B[m].T.to(x.dtype)) * self.scale
        if len(self.members) == 1:
            return outs[self.members[0]]
        lead = x.shape[:-1]
        parts = [outs.get(m, x.new_zeros(*lead, self.sizes[m][1] // tp)) for m in self.members]
        if self.members[0] == "q_proj":  # per local query group: its q rows, its k rows, its v rows
            g = self.geo.num_kv_heads // tp
            q, k, v = (p.reshape(*lead, g, -1) for p in parts)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        return torch.cat(parts, dim=-1)  # fc1: this rank's gate rows, then its up rows

    # --- whole tensors (collective over tensor-parallel ranks) ------------------------------

    def whole(self, m: str, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of HF module m, whole (or their gradients, zeros where there is none)."""
        a, b = self.lora_A[m], self.lora_B[m]
        if grad:
            a = a.grad if a.grad is not None else torch.zeros_like(a)
            b = b.grad if b.grad is not None else torch.zeros_like(b)
        a, b = a.detach(), b.detach()
        if self.layout.tp == 1:
            return a, b
        if self.kind == "column":
            return a, _gather(b, 0, self.layout)
        return _gather(a, 1, self.layout), b

    @torch.no_grad()
    def set_whole(self, m: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set HF module m's adapters from whole tensors: this rank's part of them."""
        tp, r = self.layout.tp, self.layout.tp_rank
        if self.kind == "column":
            b = b.chunk(tp, dim=0)[r]
        else:
            a = a.chunk(tp, dim=1)[r]
        for p, t, name in ((self.lora_A[m], a, "lora_A"), (self.lora_B[m], b, "lora_B")):
            if p.shape != t.shape:
                raise ValueError(f"train.lora: {m}.{name} has shape {tuple(t.shape)} for this rank, the model "
                                 f"expects {tuple(p.shape)} (another rank or model?)")
            p.copy_(t)


def _gather(t: torch.Tensor, dim: int, layout: Layout) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(layout.tp)]
    dist.all_gather(parts, t.contiguous(), group=layout.tp_group)
    return torch.cat(parts, dim=dim)


def _add_update(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: tuple[torch.Tensor, Any]
                ) -> tuple[torch.Tensor, Any]:
    """The forward hook: the layer's (output, bias) with the adapters' update added to the output."""
    out, bias = output
    x = args[0] if args else kwargs["input_"]  # Megatron's linear layers take `input_`
    return out + module.lora.delta(x), bias  # type: ignore[operator]


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, geo: names.Geometry, layout: Layout,
               hidden: int, ffn: int) -> dict[str, MegatronLora]:
    """Freeze `model` (this stage's GPTModel) and give each Megatron layer holding a targeted HF module its
    adapters; returns them by their HF layer path (`model.layers.N.self_attn` / `.mlp`) and Megatron
    layer name, e.g. `model.layers.0|self_attention.linear_qkv`."""
    check_targets(targets)
    model.requires_grad_(False)
    sizes = module_sizes(geo, hidden, ffn)
    found: dict[str, MegatronLora] = {}
    for layer in model.decoder.layers:  # type: ignore[union-attr]
        for fused, (members, _, _) in FUSED.items():
            if not set(members) & set(targets):
                continue
            linear = layer.get_submodule(fused)
            param = linear.weight
            linear.lora = MegatronLora(fused, targets, sizes, rank, alpha, geo, layout, param.dtype, param.device)
            linear.register_forward_hook(_add_update, with_kwargs=True)
            found[f"model.layers.{layer.layer_number - 1}|{fused}"] = linear.lora
    return found


def hf_path(key: str, m: str) -> str:
    """HF module path of member m of the adapters at `key` (`apply_lora`'s keys)."""
    layer, fused = key.split("|")
    return f"{layer}.{FUSED[fused][2]}.{m}"


def adapters(layers: dict[str, MegatronLora], grad: bool = False) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module path, A, B) of every adapter, whole, in the torch backend's order. Collective."""
    for key, lora in layers.items():
        for m in lora.targets:
            yield (hf_path(key, m), *lora.whole(m, grad))


def adapter_parameters(layers: dict[str, MegatronLora]) -> int:
    """Adapter parameters of the whole model (every rank's parts together)."""
    return sum(lora.rank * sum(lora.sizes[m]) for lora in layers.values() for m in lora.targets)


@torch.no_grad()
def merged_weights(model: nn.Module, layers: dict[str, MegatronLora], geo: names.Geometry, layout: Layout,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, W + alpha / rank * B A) of every adapted HF module, whole, and its bias when it has one
    (Qwen2's q/k/v), as the torch backend's `lora.merged_weights`: all that an engine holding the base model
    needs. Collective: every rank of the trainer iterates it to the end."""
    from slime_async.train.megatron.weights import _gather_tp

    for key, lora in layers.items():
        layer, fused = key.split("|")
        linear = model.decoder.layers[int(layer.rsplit(".", 1)[1])].get_submodule(fused)  # type: ignore[union-attr]
        prefix = f"decoder.layers.{layer.rsplit('.', 1)[1]}.{fused}"
        base = {}
        for part in ("weight", "bias"):
            param = getattr(linear, part, None)
            if param is None or param.numel() == 0:
                continue
            s = names.slot(f"{prefix}.{part}", geo)
            base[part] = dict(zip(s.hf_names, names.to_hf(s, _gather_tp(param.detach(), s, layout), geo),
                                  strict=True))
        for m in lora.targets:
            a, b = lora.whole(m)
            name = hf_path(key, m)
            w = base["weight"][f"{name}.weight"]
            yield f"{name}.weight", (w.float() + lora.scale * (b.float() @ a.float())).to(dtype)
            if "bias" in base:
                yield f"{name}.bias", base["bias"][f"{name}.bias"].to(dtype)
