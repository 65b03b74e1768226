"""HF -> Megatron -> HF on CPU (fp32): the same logits, and the same tensors back bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB
from transformers import AutoModelForCausalLM

from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.megatron.cpu_compat import cpu_megatron

FAMILIES = ["qwen2", "llama", "qwen3"]


@pytest.fixture(scope="module")
def backends(family_dirs: dict[str, Path]) -> dict[str, MegatronBackend]:
    return {name: MegatronBackend(family_dirs[name], device="cpu") for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_hf_logits(family: str, family_dirs: dict[str, Path],
                                         backends: dict[str, MegatronBackend]) -> None:
    hf = AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    be = backends[family]
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), cpu_megatron():
        got = be.module(input_ids=ids, position_ids=torch.arange(40).expand(3, -1), attention_mask=None)
        want = hf(input_ids=ids).logits
    assert got.shape == (3, 40, be.shape.padded_vocab_size) and be.shape.padded_vocab_size == 384
    torch.testing.assert_close(got[..., :VOCAB], want, atol=1e-4, rtol=0)
    assert want.abs().max() > 1.0  # logits of real size, not a degenerate model


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_round_trip_is_bit_exact(family: str, family_dirs: dict[str, Path],
                                                backends: dict[str, MegatronBackend]) -> None:
    hf = dict(AutoModelForCausalLM.from_pretrained(family_dirs[family]).named_parameters())  # tied: once
    exported = list(backends[family].named_weights())
    names = [n for n, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(hf)  # every tensor once
    for name, tensor in exported:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, hf[name]), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_scaling_is_what_transformers_computes(family: str, family_dirs: dict[str, Path],
                                                    backends: dict[str, MegatronBackend]) -> None:
    """llama3 and linear scaling change the frequencies: the logits test alone, on 40 positions, would
    hardly notice wrong low frequencies."""
    ours = backends[family].module.rotary_pos_emb.inv_freq.cpu()
    hf = AutoModelForCausalLM.from_pretrained(family_dirs[family]).model.rotary_emb.inv_freq
    shape = backends[family].shape
    plain = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    assert torch.equal(ours, hf) and not torch.allclose(ours, plain)


@pytest.mark.parametrize(("change", "field"), [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 32}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type"),
])
def test_unsupported_configs_are_refused_naming_the_field(change: dict, field: str, family_dirs: dict[str, Path],
                                                          tmp_path: Path) -> None:
    src = family_dirs["qwen2"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        MegatronBackend(tmp_path, device="cpu")


def test_parallel_sizes_that_do_not_split_the_model_name_the_field(family_dirs: dict[str, Path]) -> None:
    from slime_async.config.schema import MegatronConfig

    with pytest.raises(ValueError, match=r"train\.megatron\.tensor_parallel: 3 does not divide"):
        MegatronBackend(family_dirs["qwen2"], device="cpu", parallel=MegatronConfig(tensor_parallel=3))
    with pytest.raises(ValueError, match=r"train\.megatron\.pipeline_parallel"):
        MegatronBackend(family_dirs["qwen2"], device="cpu", parallel=MegatronConfig(pipeline_parallel=2))
    with pytest.raises(ValueError, match=r"train\.megatron\.data_parallel: 2"):
        MegatronBackend(family_dirs["qwen2"], device="cpu", parallel=MegatronConfig(data_parallel=2))
    with pytest.raises(ValueError, match=r"model\.dtype"):
        MegatronBackend(family_dirs["qwen2"], device="cpu", dtype="bfloat16")


def test_a_bfloat16_model_is_bfloat16_throughout_and_close_to_float32(family_dirs: dict[str, Path],
                                                                      backends: dict[str, MegatronBackend]) -> None:
    """The GPU's mixed precision path, built on CPU: every parameter bf16 (the local spec's norms are
    made in float32 by Megatron), forward and backward run, logits near the float32 model's."""
    from slime_async.train.megatron.model import build_gpt_model, transformer_config
    from slime_async.train.megatron.weights import HFWeights, load_hf, mark_tensor_parallel

    be = backends["qwen3"]
    config = transformer_config(be.shape, tensor_parallel=1, pipeline_parallel=1, dtype=torch.bfloat16, on_gpu=False)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, -1)
    with cpu_megatron():
        model = build_gpt_model(be.shape, config, "sdpa")
        mark_tensor_parallel(model, be.geometry)
        load_hf(model, HFWeights(family_dirs["qwen3"]), be.geometry, be.layout)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        low = model(input_ids=ids, position_ids=pos, attention_mask=None)
        low.float().logsumexp(-1).sum().backward()
        with torch.no_grad():
            high = be.module(input_ids=ids, position_ids=pos, attention_mask=None)
    assert low.dtype == torch.bfloat16 and all(p.grad is not None for p in model.parameters())
    assert 0 < (low.float() - high).abs().max() < 0.25
