"""Checkpoint names <-> the parameters of a loaded transformers model.

A Hugging Face checkpoint (and SGLang, vLLM and our weight wire) names each expert's weights apart:
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`. transformers 5 loads them fused, one
parameter per layer: `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up
rows) and `mlp.experts.down_proj` [E, H, I]. Everything else keeps its name.

`checkpoint_views` maps every checkpoint name to a view of the module's own storage: exporting reads
the views, an in-place update copies into them, and no fused tensor is ever rebuilt. The layout is
checked against transformers' own `save_pretrained` in `tests/moe/test_hf_layout.py`.
"""

from __future__ import annotations

import re

import torch

_FUSED = re.compile(r"^(?P<base>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name: view of the parameter it lives in}, in the model's parameter order.

    The views are detached (no autograd history) and share the parameters' memory. Tied weights
    appear once, under the name `named_parameters` gives them (as `save_pretrained` writes them)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        data = param.detach()
        m = _FUSED.match(name)
        if m is None:
            out[name] = data
            continue
        if data.dim() != 3:
            raise ValueError(f"{name}: expected a fused [experts, out, in] parameter, got shape {tuple(data.shape)}")
        base = m["base"]
        if m["kind"] == "gate_up_proj":
            half = data.shape[1] // 2
            for e in range(data.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = data[e, :half]
                out[f"{base}.{e}.up_proj.weight"] = data[e, half:]
        else:
            for e in range(data.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = data[e]
    return out
