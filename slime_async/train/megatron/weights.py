"""Moving weights between a HF checkpoint and this process's shard of the Megatron model.

Loading reads only the HF tensors this rank needs (safetensors, lazily), builds each parameter's
full tensor with `sync.megatron_names` and copies this rank's tensor-parallel shard in place.
Exporting is collective: every rank of the trainer iterates `export_hf` in lockstep; tensor-parallel
shards are all-gathered, and each pipeline stage in turn broadcasts its tensors, so every rank sees
the whole model in HF names (the publisher uses rank 0's). With expert parallelism a rank loads only
its own experts, and export all-gathers each expert weight over the expert-parallel group (every rank
of it holds the same local index of different experts), so again every rank sees every expert.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from slime_async.sync import megatron_names as names
from slime_async.train.megatron.parallel import Layout

WEIGHT_FILES = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin.*)$")


class HFWeights:
    """Tensors of a HF model directory by name, read on demand from its safetensors files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.path / "model.safetensors").is_file():
            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.files = {k: self.path / "model.safetensors" for k in f.keys()}  # noqa: SIM118
        else:
            raise ValueError(f"model.path: {self.path} has no safetensors weights (model.safetensors or its index)")
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"model.path: {self.path} has no tensor {name!r}")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(name)


_STACKED = {"weight1": "linear_fc1.weight", "weight2": "linear_fc2.weight"}
"""`GroupedExperts`' stacked parameters and the per-expert (SequentialMLP) names their slices take."""


def global_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name with global layer and expert numbers, parameter) of this stage's model; empty placeholders
    (which some Transformer Engine layers register for absent biases) and LoRA adapters are skipped. A
    grouped layer's stacked expert weight comes as one view per expert under SequentialMLP's name for
    that expert (writing into the view writes the parameter), with the matching view of its gradient as
    `.grad`, so every caller sees one tensor per expert whichever experts module the model runs."""
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    experts = {i: layer.mlp.local_expert_indices for i, layer in enumerate(model.decoder.layers)
               if hasattr(layer.mlp, "local_expert_indices")}
    for name, param in model.named_parameters():
        if param.numel() == 0 or ".lora." in name:  # LoRA adapters (`megatron.lora`) have no HF weight
            continue
        if m := re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name):
            local, rest = int(m.group(1)), m.group(2)
            prefix = f"decoder.layers.{local_to_global[local]}."
            if (stacked := re.match(r"^mlp\.experts\.(weight[12])$", rest)) and local in experts:
                for i, expert in enumerate(experts[local]):
                    view = param.detach()[i]
                    if param.grad is not None:
                        view.grad = param.grad[i]
                    yield f"{prefix}mlp.experts.local_experts.{expert}.{_STACKED[stacked.group(1)]}", view
                continue
            if e := re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest):
                rest = f"mlp.experts.local_experts.{experts[local][int(e.group(1))]}.{e.group(2)}"
            name = prefix + rest
        yield name, param


def is_expert(name: str) -> bool:
    """Is this (global) Megatron parameter one expert's, held by one rank of the expert-parallel group?"""
    return names.EXPERT_NAME.match(name) is not None


def _expert_peers(name: str, geo: names.Geometry, layout: Layout) -> list[str]:
    """The names of the experts that the expert-parallel ranks hold at `name`'s local index, in rank order."""
    m = names.EXPERT_NAME.match(name)
    assert m is not None
    # rank r holds experts r * local ... (r + 1) * local - 1 (Megatron's MoELayer.local_expert_indices)
    local = geo.num_experts // layout.ep
    i = int(m.group(2)) - layout.ep_rank * local
    return [f"{m.group(1)}{r * local + i}{m.group(3)}" for r in range(layout.ep)]


def mark_tensor_parallel(model: torch.nn.Module, geo: names.Geometry) -> None:
    """Flag the tensor-parallel parameters as Megatron's own initialisation would have.

    Megatron sets `tensor_model_parallel` / `partition_dim` on a weight only while initialising it
    (`perform_initialization`), which loading weights skips; without the flags, gradient norms count
    every shard as a duplicate of rank 0's."""
    for name, param in global_names(model):
        s = names.slot(name, geo)
        if s.partition_dim is not None and not getattr(param, "tensor_model_parallel", False):
            param.tensor_model_parallel = True
            param.partition_dim = s.partition_dim
            param.partition_stride = 1


@torch.no_grad()
def load_hf(model: torch.nn.Module, weights: HFWeights, geo: names.Geometry, layout: Layout) -> None:
    """Copy this rank's shard of every parameter of `model` from the HF tensors (in place: the
    parameters may live in DDP's contiguous buffers)."""
    for name, param in global_names(model):
        s = names.slot(name, geo)
        full = names.to_megatron(s, [weights.get(h) for h in s.hf_names], geo)
        part = names.shard(full, s, layout.tp, layout.tp_rank)
        if part.shape != param.shape:
            raise ValueError(f"model.path: {name} from {s.hf_names} has shape {tuple(part.shape)}, the Megatron "
                             f"model expects {tuple(param.shape)}")
        param.copy_(part)


@torch.no_grad()
def export_hf(model: torch.nn.Module, geo: names.Geometry, layout: Layout, dtype: torch.dtype
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model once, in `dtype`, on this rank's device. Collective: all
    ranks of the trainer must iterate it to the end together."""
    for stage in range(layout.pp):
        mine = stage == layout.pp_rank
        listing = None
        if mine:
            listing = [(name, tuple(p.shape), p.dtype) for name, p in global_names(model)
                       if names.exported(name, geo)]
        if layout.pp > 1:
            box = [listing]
            dist.broadcast_object_list(box, group_src=stage, group=layout.pp_group)
            listing = box[0]
        params = dict(global_names(model)) if mine else {}
        assert listing is not None
        for name, shape, param_dtype in listing:
            s = names.slot(name, geo)
            full_shape = list(shape)
            if s.partition_dim is not None:
                full_shape[s.partition_dim] *= layout.tp
            # an expert's weight: one per expert-parallel rank (all ranks of a pipeline group hold the same
            # expert-parallel rank, so the names agree across stages)
            peers = _expert_peers(name, geo, layout) if layout.ep > 1 and is_expert(name) else [name]
            if mine:
                full = _gather_tp(params[name].detach(), s, layout)
                fulls = _gather_ep(full, layout) if len(peers) > 1 else [full]
            else:
                fulls = [torch.empty(full_shape, dtype=param_dtype, device=layout.device) for _ in peers]
            for peer, full in zip(peers, fulls, strict=True):
                if layout.pp > 1:
                    dist.broadcast(full, group_src=stage, group=layout.pp_group)
                ps = s if peer == name else names.slot(peer, geo)
                for hf_name, tensor in zip(ps.hf_names, names.to_hf(ps, full, geo), strict=True):
                    yield hf_name, tensor.to(dtype)


class LocalExport:
    """`export_hf` for a trainer that holds the whole model (tensor, pipeline and expert parallel size
    1: nothing to gather), planned once: which parameter each HF tensor comes from, and the HF tensor
    itself where it is a view of the parameter (all but the q/k/v split of the fused QKV weight, which
    is a copy each time). Walking the modules and naming every parameter took 4 ms of Python per export
    for a 12-layer model (146 tensors), more than the copies themselves on a GPU (1.2 ms for 2.5 GB at
    the copy bound). The views stay right for the backend's life: parameters are updated in place
    (optimizer steps, `load_hf`, DDP's buffers are allocated once)."""

    def __init__(self, model: torch.nn.Module, geo: names.Geometry) -> None:
        self.geo = geo
        self.plan: list[tuple[torch.Tensor, names.Slot, list[torch.Tensor] | None]] = []
        for name, param in global_names(model):
            if not names.exported(name, geo):
                continue
            s = names.slot(name, geo)
            param = param.detach()
            tensors = names.to_hf(s, param, geo)
            views = all(t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr() for t in tensors)
            self.plan.append((param, s, tensors if views else None))

    def __call__(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for param, s, views in self.plan:  # detached parameters: nothing here records a gradient
            for hf_name, tensor in zip(s.hf_names, views or names.to_hf(s, param, self.geo), strict=True):
                yield hf_name, tensor.to(dtype)


def _gather_ep(local: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(layout.ep)]
    dist.all_gather(parts, local.contiguous(), group=layout.ep_group)
    return parts


def _gather_tp(local: torch.Tensor, s: names.Slot, layout: Layout) -> torch.Tensor:
    if s.partition_dim is None or layout.tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.tp)]
    dist.all_gather(parts, local.contiguous(), group=layout.tp_group)
    return names.unshard(parts, s)


def save_hf_dir(tensors: Iterator[tuple[str, torch.Tensor]], source: Path, out: Path, write: bool,
                shard_bytes: int = 4 * 2**30) -> None:
    """Write a HF model directory: `source`'s config and tokenizer files and `tensors` as safetensors
    shards (with an index when there are several). Every rank consumes `tensors` (it is collective);
    only the rank with `write` writes."""
    if write:
        out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and not WEIGHT_FILES.match(f.name):
                shutil.copy(f, out / f.name)
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, tensor in tensors:
        if not write:
            continue
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    if not write:
        return
    flush()
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
    else:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
