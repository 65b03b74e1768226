"""Checkpoint names of a loaded transformers model: against transformers' own save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime_async.moe.hf_layout import checkpoint_views


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_moe_dir"])
def test_views_are_what_save_pretrained_writes(which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(which))
    torch.manual_seed(0)
    with torch.no_grad():  # distinct values everywhere, so a swapped expert or half cannot pass
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    views = checkpoint_views(model)
    assert sorted(views) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(views[name], tensor), name


def test_copying_into_a_view_updates_the_fused_parameter(tiny_moe_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    experts = model.model.layers[2].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2
    views = checkpoint_views(model)
    up = torch.randn_like(views["model.layers.2.mlp.experts.5.up_proj.weight"])
    down = torch.randn_like(views["model.layers.2.mlp.experts.7.down_proj.weight"])
    views["model.layers.2.mlp.experts.5.up_proj.weight"].copy_(up)
    views["model.layers.2.mlp.experts.7.down_proj.weight"].copy_(down)
    assert torch.equal(experts.gate_up_proj[5, half:], up)
    assert torch.equal(experts.down_proj[7], down)
    assert not torch.equal(experts.gate_up_proj[5, :half], up)  # the gate half is another tensor
