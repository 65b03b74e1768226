"""MoE configs that no part computes are refused before anything starts, naming the config field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_preflight import assert_one_line, slime_async
from transformers import AutoConfig

from slime_async.config.loader import ConfigError
from slime_async.config.model_dir import check_model_dir
from slime_async.moe.shape import moe_shape

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"n_group": 8, "topk_group": 4}, "n_group: 8: grouped top-k routing"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size: 512: shared experts"),
    ({"n_shared_experts": 1}, "n_shared_experts: 1: shared experts"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers: [0]: dense layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step: 2: every layer must be sparse"),
    ({"scoring_func": "sigmoid"}, "scoring_func: 'sigmoid' is not supported"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor: 2.5: scaled routing"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok: 9 must be between 1 and num_experts (8)"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "shared_expert_intermediate_size"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
     "model_type 'mixtral' is a mixture-of-experts model this project does not convert"),
]


def edited(tiny_moe_dir: Path, out: Path, **changes: Any) -> Path:
    shutil.copytree(tiny_moe_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize(("changes", "message"), REFUSED)
def test_each_unsupported_field_is_named(changes: dict[str, Any], message: str, tiny_moe_dir: Path,
                                         tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path: .*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        check_model_dir(edited(tiny_moe_dir, tmp_path / "m", **changes))


def test_the_tiny_moe_and_dense_models_pass(tiny_moe_dir: Path, tiny_model_dir: Path) -> None:
    shape = moe_shape(AutoConfig.from_pretrained(tiny_moe_dir))
    assert shape is not None and (shape.num_experts, shape.top_k, shape.route_width) == (8, 2, 8)
    assert moe_shape(AutoConfig.from_pretrained(tiny_model_dir)) is None
    assert check_model_dir(tiny_moe_dir) == tiny_moe_dir


def test_train_stops_at_once_with_one_line(tiny_moe_dir: Path, tmp_path: Path) -> None:
    bad = edited(tiny_moe_dir, tmp_path / "grouped", n_group=8, topk_group=4)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {bad}\nrun:\n  dir: {tmp_path / 'runs'}\n")
    result = slime_async(tmp_path, "train", str(config))
    assert_one_line(result, "model.path: config.json n_group: 8: grouped top-k routing")
    assert not (tmp_path / "runs").exists()
