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
                        ("MICROS", (1, 2)), ("LAYERS", 2), ("SHAPE", shape), ("CONCURRENCY", 32), ("PROMPT", 8),
                        ("DECODE_STEPS", 2)):
        monkeypatch.setattr(bench, name, value)
    result = bench.run(quick=True)
    assert not result.details["errors"], result.details["errors"]
    decode = "engine decode, 32 requests"
    names = [r[:2] for r in result.rows]
    # the profile runs at the faster micro-batch size, either of the two here
    assert names[3][0] == "step profile (GPU ms)" and names[3][1].startswith("routed by the model")
    assert names[:3] + names[4:] == [["train step", "routed by the model"], ["train step", "routing replay"],
                                     ["train step", "routed by the model, micro-batch 2"],
                                     ["train step", "grouped, Megatron's all-to-all dispatcher"],
                                     ["train step", "SequentialMLP, routed by the model"],
                                     ["train step", "dense, same active parameters"],
                                     ["train step", "dense, same active parameters, micro-batch 2"],
                                     [decode, "MoE, eager step"], [decode, "MoE, CUDA-graph step"],
                                     [decode, "MoE, CUDA-graph step, grouped experts"],
                                     [decode, "dense, eager step"], [decode, "dense, CUDA-graph step"]]
    assert result.details["train"]["routed by the model, micro-batch 2"]["micro_batch"] == 2
    assert set(result.details["decode_profile"]) == {"MoE, eager step", "MoE, CUDA-graph step",
                                                     "MoE, CUDA-graph step, grouped experts"}
    for key in ("routed by the model", "routed by the model, micro-batch 2", "routing replay",
                "grouped, Megatron's all-to-all dispatcher", "SequentialMLP, routed by the model"):
        train = result.details["train"][key]
        assert train["tflops"] > 0 and train["metrics"]["moe/aux_loss"] > 0.5
    dense = result.details["train"]["dense, same active parameters"]
    assert dense["tflops"] > 0 and "moe/aux_loss" not in dense["metrics"]
    assert all(rate > 0 for rate in result.details["decode"].values()) and len(result.details["decode"]) == 5
    assert "SequentialMLP" in result.headline and "all-to-all" in result.headline and "MoE/dense" in result.headline
    assert result.details["grouped_kernel"] == "torch._grouped_mm"
    assert result.details["train"]["routing replay"]["metrics"]["moe/route_mismatch"] > 0.3
    # active parameters: 2 layers x (QKV 64 x (64 + 2 x 32), output 64 x 64, router 64 x 8, 2 experts x 3 x 64 x 32)
    # + the LM head 64 x 300
    # decode at 32 requests of top-2 over 8 experts: 8 x (1 - (3/4)^32) experts touched a layer (nearly all)
    touched = 8 * (1 - 0.75**32)
    assert result.details["decode_weight_bytes"]["MoE"] == pytest.approx(
        2 * (2 * (64 * 128 + 64 * 64 + 64 * 8 + touched * 3 * 64 * 32) + 64 * 300))
    assert "weight bytes" in result.headline
    assert bench.active_params(2) == 2 * (64 * 128 + 64 * 64 + 64 * 8 + 2 * 3 * 64 * 32) + 64 * 300
    # the dense model: the same without the router, its MLP 2 x 32 wide
    assert bench.active_params(2, dense=True) == 2 * (64 * 128 + 64 * 64 + 3 * 64 * 64) + 64 * 300
    assert result.details["dense_params"] == bench.active_params(2, dense=True) + 64 * 300 + 2 * (2 * 64 + 2 * 16) + 64


def test_the_moe_benchmark_takes_as_many_layers_as_the_gpu_holds() -> None:
    """Qwen3-30B-A3B's layer is 0.62B parameters and its embedding and head 0.62B, 18 bytes each with
    the optimizer state, in 3/4 of the GPU's memory: 6 layers (the most) on an H200, 4 on an H100."""
    layer, ends = bench.layer_params()
    assert 0.62e9 < layer < 0.63e9 and 0.62e9 < ends < 0.63e9
    assert bench.layers_that_fit(143771 * 2**20) == 6  # an H200
    assert bench.layers_that_fit(81559 * 2**20) == 4  # an H100
    assert bench.layers_that_fit(8 * 2**30) == 1
