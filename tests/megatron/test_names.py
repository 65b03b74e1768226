"""The HF <-> Megatron layouts under tensor parallelism, as pure tensor functions (no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from slime_async.sync import megatron_names as names


def geometry(tp: int, heads: int = 8, kv: int = 2, tied: bool = False) -> names.Geometry:
    return names.Geometry(num_heads=heads, num_kv_heads=kv, head_dim=4, vocab_size=10, padded_vocab_size=16,
                          tensor_parallel=tp, tied_embeddings=tied)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_qkv_groups_each_query_group_with_its_key_and_value(tp: int) -> None:
    geo = geometry(tp)
    s = names.slot("decoder.layers.3.self_attention.linear_qkv.weight", geo)
    assert s.hf_names[0] == "model.layers.3.self_attn.q_proj.weight" and s.partition_dim == 0
    q, k, v = torch.randn(32, 6), torch.randn(8, 6), torch.randn(8, 6)
    full = names.to_megatron(s, [q, k, v], geo)
    # group 0: query heads 0-3 (16 rows), key head 0, value head 0; then group 1
    assert torch.equal(full[:16], q[:16]) and torch.equal(full[16:20], k[:4]) and torch.equal(full[20:24], v[:4])
    assert torch.equal(full[24:40], q[16:]) and torch.equal(full[40:44], k[4:])
    shards = [names.shard(full, s, tp, r) for r in range(tp)]
    back = names.to_hf(s, names.unshard(shards, s), geo)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v], strict=True))
    bias = names.slot("decoder.layers.0.self_attention.linear_qkv.bias", geo)
    qb, kb, vb = torch.randn(32), torch.randn(8), torch.randn(8)
    assert all(torch.equal(a, b) for a, b in zip(
        names.to_hf(bias, names.to_megatron(bias, [qb, kb, vb], geo), geo), [qb, kb, vb], strict=True))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_shard_of_each_rank_is_its_gate_rows_then_its_up_rows(tp: int) -> None:
    geo = geometry(tp)
    s = names.slot("decoder.layers.0.mlp.linear_fc1.weight", geo)
    gate, up = torch.randn(16, 6), torch.randn(16, 6)
    full = names.to_megatron(s, [gate, up], geo)
    rows = 16 // tp
    for r in range(tp):
        part = names.shard(full, s, tp, r)
        assert torch.equal(part[:rows], gate[r * rows:(r + 1) * rows])
        assert torch.equal(part[rows:], up[r * rows:(r + 1) * rows])
    back = names.to_hf(s, full, geo)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_vocabulary_rows_are_padded_and_unpadded_and_row_parallel_splits_columns() -> None:
    geo = geometry(2)
    emb = names.slot("embedding.word_embeddings.weight", geo)
    w = torch.randn(10, 6)
    full = names.to_megatron(emb, [w], geo)
    assert full.shape == (16, 6) and torch.equal(full[:10], w) and not full[10:].any()
    assert torch.equal(names.to_hf(emb, full, geo)[0], w)
    assert names.shard(full, emb, 2, 1).shape == (8, 6)
    proj = names.slot("decoder.layers.1.self_attention.linear_proj.weight", geo)
    assert proj.hf_names == ("model.layers.1.self_attn.o_proj.weight",) and proj.partition_dim == 1
    assert names.slot("decoder.final_layernorm.weight", geo).partition_dim is None


def test_tied_output_layer_is_the_embedding_and_not_exported_twice() -> None:
    tied, untied = geometry(1, tied=True), geometry(1)
    assert names.slot("output_layer.weight", tied).hf_names == ("model.embed_tokens.weight",)
    assert names.slot("output_layer.weight", untied).hf_names == ("lm_head.weight",)
    assert not names.exported("output_layer.weight", tied) and names.exported("output_layer.weight", untied)
    # Transformer Engine's fused layer norms map to the same HF norms as the local spec's
    te = names.slot("decoder.layers.2.self_attention.linear_qkv.layer_norm_weight", tied)
    assert te.hf_names == ("model.layers.2.input_layernorm.weight",)
    with pytest.raises(KeyError, match="no HF counterpart"):
        names.slot("decoder.layers.0.mlp.router.weight", tied)
