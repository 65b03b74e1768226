"""The Megatron backend on a mixture-of-experts model, one CUDA GPU (issue 31): Qwen3-30B-A3B's layer
shape with fewer layers, random weights, bf16 + Adam.

Shape: hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of intermediate 768, top-8
(renormalised), untied 151,936 vocabulary, as many layers as the GPU holds, at most 6 (`layers_that_fit`:
each layer is 0.62B parameters, the embedding and the LM head 0.62B together, at 18 bytes each with
Megatron's bf16 weights, fp32 gradients, fp32 master weights and Adam moments; 6 layers = 4.4B
parameters = 79 GB plus activations on a 141 GB H200, 4 on an 80 GB H100: 64 GB at its peak there).

- Train step (`MegatronBackend.train_step`, micro-batch 1, sequences of 4096): tokens/s, TFLOP/s and
  MFU counted on the ACTIVE parameters (what a token computes): per token and layer, forward
  2 x (QKV + output projection + router + k experts x 3 x hidden x expert intermediate) multiply-adds
  plus attention's QK^T and PV over the causal half ((s + 1) / 2 keys), and the LM head
  2 x hidden x vocab; forward + backward = 3 x forward (`train_flops`). MFU = achieved / 790 TFLOP/s
  (the bf16 matmul rate measured on the H200, MEASURED.md). The step's router losses are logged
  (`moe/aux_loss`: 1.0 is balanced; `moe/z_loss`).
- The same step with routing replay (every token's experts given by a record, as an engine would
  report them): its cost over routing by the model.

Run: `slime-async bench megatron_moe_gpu`; `--quick` times one step after the warm-up instead of three.
The module constants shrink everything for the CPU smoke test (tests/megatron/test_moe_bench.py).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import Result

DESCRIPTION = ("megatron backend on a CUDA GPU, MoE: Qwen3-30B-A3B layers (128 experts, top-8), bf16: "
               "train-step tokens/s and MFU on active parameters, router losses, routing replay")

CEILING_TFLOPS = 790.0  # bf16 matmul rate measured on the H200 (MEASURED.md)
DEVICE = "cuda"  # module constants, so that the CPU smoke test can shrink everything
TRAIN_DTYPE = "bfloat16"
SEQ = 4096
SEQUENCES = 4
LAYERS: int | None = None  # None: `layers_that_fit` the GPU
MAX_LAYERS = 6
BYTES_PER_PARAM = 18  # bf16 weight, fp32 gradient buffer, fp32 master weight, Adam's two fp32 moments
HEADROOM = 0.75  # of the GPU's memory for the above; the rest for activations, logits and the allocator
SHAPE: dict[str, Any] = dict(
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True,
    vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)


def layer_params() -> tuple[int, int]:
    """(parameters of one layer, of the embedding and LM head together)."""
    h, q, kvd = SHAPE["hidden_size"], SHAPE["num_attention_heads"] * SHAPE["head_dim"], \
        SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    experts = SHAPE["num_experts"] * 3 * h * SHAPE["moe_intermediate_size"]
    return h * (q + 2 * kvd) + q * h + h * SHAPE["num_experts"] + experts + 4 * h, 2 * h * SHAPE["vocab_size"]


def layers_that_fit(gpu_bytes: int) -> int:
    """As many layers as a GPU of `gpu_bytes` holds with the optimizer state (at most MAX_LAYERS)."""
    layer, ends = layer_params()
    return max(1, min(MAX_LAYERS, int((HEADROOM * gpu_bytes / BYTES_PER_PARAM - ends) // layer)))


def train_flops(seq: int, sequences: int, layers: int) -> float:
    """FLOPs of one train step (forward + backward) over `sequences` rows of `seq` tokens, counting the
    parameters each token is routed through (the active ones), not all experts."""
    h, heads, kv, hd = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], \
        SHAPE["head_dim"]
    experts, k, inter, vocab = SHAPE["num_experts"], SHAPE["num_experts_per_tok"], SHAPE["moe_intermediate_size"], \
        SHAPE["vocab_size"]
    q, kvd = heads * hd, kv * hd
    per_layer = h * (q + 2 * kvd) + q * h + h * experts + k * 3 * h * inter
    matmul = 2 * layers * per_layer + 2 * h * vocab
    attention = 2 * 2 * layers * q * (seq + 1) / 2
    return 3 * (matmul + attention) * seq * sequences


def active_params(layers: int) -> int:
    """Parameters a token computes with: attention, router, k experts per layer, and the LM head."""
    h, q, kvd = SHAPE["hidden_size"], SHAPE["num_attention_heads"] * SHAPE["head_dim"], \
        SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    per_layer = h * (q + 2 * kvd) + q * h + h * SHAPE["num_experts"] + \
        SHAPE["num_experts_per_tok"] * 3 * h * SHAPE["moe_intermediate_size"]
    return layers * per_layer + h * SHAPE["vocab_size"]


def _make_model(out: Path, layers: int) -> int:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=layers, max_position_embeddings=SEQ, **SHAPE)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, TRAIN_DTYPE))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    return params


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _replayed(batch: Any, layers: int) -> Any:
    """The batch with a routing record for every token: k distinct random experts per layer."""
    n, t = batch.input_ids.shape
    k, experts = SHAPE["num_experts_per_tok"], SHAPE["num_experts"]
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(n, t, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    return dataclasses.replace(batch, routed_experts=ids.reshape(n, t, layers * k).to(torch.int16))


def _time_steps(be: Any, batch: Any, steps: int) -> tuple[float, dict[str, float]]:
    """(median train-step seconds after one warm-up, the last step's metrics)."""
    from slime_async.config.schema import TrainConfig
    from slime_async.train.objective import Objective

    obj = Objective(TrainConfig(loss="grpo"))
    times, metrics = [], {}
    for i in range(steps + 1):
        prox = be.logprobs(batch, 1.0).logprobs
        _sync()
        t = time.perf_counter()
        result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0)
        _sync()
        if not result.applied:
            raise RuntimeError(f"train step not applied: {result.reason}")
        if i:
            times.append(time.perf_counter() - t)
        metrics = result.metrics
    return statistics.median(times), metrics


def _profile(be: Any, batch: Any, rows: list, details: dict) -> None:
    """One step (routed by the model) under torch's profiler: GPU time by kernel category and the time
    the GPU waited for the host (the experts are a Python loop: `SequentialMLP`)."""
    from benchmarks.gpu_anchor import kernel_breakdown, profile_note
    from slime_async.config.schema import TrainConfig
    from slime_async.train.objective import Objective

    obj = Objective(TrainConfig(loss="grpo"))
    prox = be.logprobs(batch, 1.0).logprobs
    try:
        prof = kernel_breakdown(lambda: be.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0), DEVICE,
                                top=15)
    except Exception:  # the timed rows stand without it
        details["errors"]["profile"] = traceback.format_exc()
        return
    details["profile"] = prof
    rows.append(["step profile (GPU ms)", "routed by the model", "", "", "", prof["wall_s"] * 1e3, "",
                 profile_note(prof)])


def run(quick: bool = False) -> Result:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("megatron_moe_gpu needs a CUDA GPU")
    from benchmarks.megatron_gpu import _batch
    from slime_async.train.megatron.backend import MegatronBackend

    layers = LAYERS or layers_that_fit(torch.cuda.get_device_properties(0).total_memory)
    rows: list[list[Any]] = []
    details: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                               "shape": {**SHAPE, "num_hidden_layers": layers}, "seq": SEQ, "sequences": SEQUENCES,
                               "ceiling_tflops": CEILING_TFLOPS, "active_params": active_params(layers),
                               "flops_per_step": train_flops(SEQ, SEQUENCES, layers), "train": {}, "errors": {}}
    steps = 1 if quick else 3
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        details["params"] = _make_model(model_dir, layers)
        details["make_model_s"] = time.perf_counter() - began
        be = MegatronBackend(model_dir, device=DEVICE, dtype=TRAIN_DTYPE, micro_batch_size=1,  # type: ignore[arg-type]
                             lr=1e-5)
        details["build_s"] = time.perf_counter() - began - details["make_model_s"]
        batch = _batch(SEQUENCES, SEQ, SHAPE["vocab_size"])
        flops, tokens = train_flops(SEQ, SEQUENCES, layers), SEQUENCES * SEQ
        for key, b in (("routed by the model", batch), ("routing replay", _replayed(batch, layers))):
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                step_s, metrics = _time_steps(be, b, steps)
            except Exception:  # keep going: the other row still reports
                details["errors"][key] = traceback.format_exc()
                print(details["errors"][key], flush=True)
                rows.append(["train step", key, "failed", "", "", "", "", traceback.format_exc(limit=1)[-200:]])
                continue
            tflops = flops / step_s / 1e12
            peak = torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0
            rows.append(["train step", key, tokens / step_s, tflops, 100 * tflops / CEILING_TFLOPS, step_s * 1e3,
                         peak, f"aux {metrics.get('moe/aux_loss', float('nan')):.4f}, "
                               f"z {metrics.get('moe/z_loss', float('nan')):.3g}"
                         + (f", route mismatch {metrics['moe/route_mismatch']:.2f}"
                            if "moe/route_mismatch" in metrics else "")])
            details["train"][key] = {"step_s": step_s, "tokens": tokens, "tflops": tflops,
                                     "mfu": tflops / CEILING_TFLOPS, "peak_gb": peak, "metrics": metrics}
        _profile(be, batch, rows, details)
    details["seconds"] = time.perf_counter() - began
    base = details["train"].get("routed by the model", {})
    return Result(
        columns=["what", "config", "tok/s", "TFLOP/s (active)", "MFU %", "ms", "peak GB", "note"],
        rows=rows,
        headline=(f"MoE train step ({layers} Qwen3-30B-A3B layers, {details['params'] / 1e9:.2f}B params, "
                  f"{details['active_params'] / 1e9:.2f}B active): {base.get('tflops', float('nan')):.0f} TFLOP/s "
                  f"= {100 * base.get('mfu', float('nan')):.1f}% MFU on active parameters"),
        details=details,
    )
