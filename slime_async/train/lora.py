"""LoRA for the torch backend: low-rank adapters on chosen linear layers; only the adapters train.

Each targeted `nn.Linear` (by its attribute name: `q_proj`, `down_proj`, ...) is wrapped in a
`LoraLinear`: the frozen base weight W plus (alpha / rank) * B A, with A [rank, in] random and B
[out, rank] zero, so the adapted model starts exactly at the base model (Hu et al. 2021). Everything
else is frozen.

Our own small module rather than peft: peft wraps the model in a `PeftModel` whose parameter names,
`save_pretrained` and forward hooks the backend would have to undo at every boundary it has (HF
names for the engines, the MoE routers' hooks, checkpoints that resume bit-exactly), for a feature
that is 80 lines here. The adapters are still saved in peft's format (`adapter_config.json`,
`adapter_model.safetensors` with peft's names), which SGLang's and vLLM's LoRA loaders read.

The engines get the merged weights, W + (alpha / rank) B A, under the base model's names, and only
those of the targeted layers: nothing else ever changes, and an engine (re)started on the base model
already holds the rest. An engine that loads adapters itself (vLLM's LoRA routes:
`config.engine_kinds.EngineKind.lora_adapters`) gets the adapters instead (`adapter_tensors`), a few
percent of the merged bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slime_async.sync.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_config


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update (alpha / rank) * B A."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) initialise A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T.to(x.dtype) @ self.lora_B.T.to(x.dtype)) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scale * (self.lora_B @ self.lora_A)


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> dict[str, LoraLinear]:
    """Freeze `model` and wrap every `nn.Linear` whose attribute name is in `targets`; returns the
    wrapped layers by module path. A ValueError naming `train.lora.target_modules` when none matched."""
    model.requires_grad_(False)
    found: dict[str, LoraLinear] = {}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                if tied and child is head:  # its weight is the embedding's: a merged head would move both
                    raise ValueError(f"train.lora.target_modules: {name!r} is the output layer, whose weight is "
                                     "the input embedding's (tie_word_embeddings): adapting it would change the "
                                     "embedding too; leave it out")
                wrapped = LoraLinear(child, rank, alpha)
                setattr(module, name, wrapped)
                found[f"{path}.{name}" if path else name] = wrapped
    if not found:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"train.lora.target_modules: {targets} names no linear layer of the model; it has {linear}")
    return found


def adapter_parameters(layers: dict[str, LoraLinear]) -> int:
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in layers.values())


def merged_weights(layers: dict[str, LoraLinear]) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model's name, merged weight) of every adapted layer, and its bias when it has one: all
    that an engine holding the base model needs to serve the adapted one."""
    for path, m in layers.items():
        yield f"{path}.weight", m.merged_weight()
        if m.base.bias is not None:
            yield f"{path}.bias", m.base.bias.detach()


def adapter_tensors(layers: dict[str, LoraLinear]) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft's name, tensor) of every adapter: `base_model.model.<module path>.lora_A.weight`, `lora_B`."""
    for name, m in layers.items():
        yield f"{PEFT_PREFIX}{name}.lora_A.weight", m.lora_A.detach()
        yield f"{PEFT_PREFIX}{name}.lora_B.weight", m.lora_B.detach()


def save_adapters(layers: dict[str, LoraLinear], path: Path, base_model: str, targets: list[str]) -> None:
    """The adapters in peft's format: `adapter_model.safetensors` and `adapter_config.json`."""
    some = next(iter(layers.values()))
    write_peft({name: (m.lora_A, m.lora_B) for name, m in layers.items()}, path, base_model, some.rank, some.alpha,
               targets)


def write_peft(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], path: Path, base_model: str, rank: int,
               alpha: float, targets: list[str]) -> None:
    """(A, B) by HF module path, whole, written in peft's format (the megatron backend's too)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in adapters.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    save_file(tensors, path / ADAPTER_WEIGHTS)
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(rank, alpha, targets, base_model), indent=2))


def save_zero_adapters(model_dir: Path, rank: int, alpha: float, targets: list[str], path: Path) -> None:
    """Adapters of `model_dir`'s model that change nothing (A and B zero), in peft's format: what an
    engine that loads adapters serves before the trainer's first push. The trainer's own start
    (B zero) computes the same function, so version 0 is the base model either way. The model is
    built on the meta device: shapes only, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    zeros = {name: (torch.zeros(m.lora_A.shape), torch.zeros(m.lora_B.shape))
             for name, m in apply_lora(model, rank, alpha, targets).items()}
    write_peft(zeros, path, str(model_dir), rank, alpha, targets)


def refuse_adapters(path: Path) -> None:
    """A ValueError when `path` holds LoRA adapters, not the full weights a run without LoRA resumes from."""
    if (path / ADAPTER_WEIGHTS).is_file() and not (path / "config.json").is_file():
        raise ValueError(f"{path}: LoRA adapters, not full weights: this run was trained with train.lora "
                         "and resumes with it")


def read_peft(path: Path, modules: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by HF module path from a `write_peft` directory; a ValueError when there are no adapters
    there or they are not those of `modules`."""
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{path}: no {ADAPTER_WEIGHTS}, so no LoRA adapters: a checkpoint of full weights (a run "
                         "without train.lora) resumes without train.lora; a LoRA run starts from model.path")
    tensors = load_file(path / ADAPTER_WEIGHTS)
    expected = {f"{PEFT_PREFIX}{n}.lora_{x}.weight" for n in modules for x in "AB"}
    if set(tensors) != expected:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: its adapters are not this model's train.lora layers "
                         f"({len(tensors)} tensors, {len(expected)} expected)")
    return {n: (tensors[f"{PEFT_PREFIX}{n}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{n}.lora_B.weight"])
            for n in modules}


@torch.no_grad()
def load_adapters(layers: dict[str, LoraLinear], path: Path) -> None:
    """Adapters saved by `save_adapters` back into `layers`; a ValueError when they do not fit."""
    for name, (a, b) in read_peft(path, list(layers)).items():
        layers[name].lora_A.copy_(a)
        layers[name].lora_B.copy_(b)
