"""The MoE GPU benchmark's code path on CPU, shrunk (the real run needs the H200): it must build the
model, time steps with and without routing replay, and log the router losses."""

from __future__ import annotations

import pytest

from benchmarks import megatron_moe_gpu as bench


def test_moe_benchmark_runs_shrunk_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = {**bench.SHAPE, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 96,
             "vocab_size": 300}
    for name, value in (("DEVICE", "cpu"), ("TRAIN_DTYPE", "float32"), ("SEQ", 32), ("SEQUENCES", 2),
                        ("LAYERS", 2), ("SHAPE", shape)):
        monkeypatch.setattr(bench, name, value)
    result = bench.run(quick=True)
    assert not result.details["errors"], result.details["errors"]
    assert [r[1] for r in result.rows] == ["routed by the model", "routing replay"]
    for key in ("routed by the model", "routing replay"):
        train = result.details["train"][key]
        assert train["tflops"] > 0 and train["metrics"]["moe/aux_loss"] > 0.5
    assert result.details["train"]["routing replay"]["metrics"]["moe/route_mismatch"] > 0.3
    # active parameters: 2 layers x (QKV 64 x (64 + 2 x 32), output 64 x 64, router 64 x 8, 2 experts x 3 x 64 x 32)
    # + the LM head 64 x 300
    assert bench.active_params() == 2 * (64 * 128 + 64 * 64 + 64 * 8 + 2 * 3 * 64 * 32) + 64 * 300
