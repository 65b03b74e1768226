"""Fixtures for the Megatron backend: tiny Qwen2, Llama and Qwen3 models with every weight random."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

VOCAB = 300  # not a multiple of 128: the Megatron embedding is padded to 384 rows

CONFIGS: dict[str, PretrainedConfig] = {
    # tied embeddings, QKV bias, grouped-query attention 2:1
    "qwen2": Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True,
                         max_position_embeddings=128, rms_norm_eps=1e-6),
    # untied, 4:1 grouped-query attention, llama3 RoPE scaling that changes the low frequencies
    "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=False,
                         max_position_embeddings=128, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32}),
    # QK-norm, head_dim 32 != hidden / heads, linear RoPE scaling
    "qwen3": Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=96, tie_word_embeddings=True,
                         max_position_embeddings=128, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter seeded noise, norms and biases too (a mapping that swapped two norms or
    dropped a bias would otherwise go unseen: they start as ones and zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A HF directory per family (config and safetensors only)."""
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        path = tmp_path_factory.mktemp(name)
        torch.manual_seed(i)
        randomized(AutoModelForCausalLM.from_config(config), seed=i).save_pretrained(path)
        out[name] = path
    return out
