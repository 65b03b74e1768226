"""The Megatron backend on a mixture-of-experts model, one CUDA GPU (issues 31, 39): Qwen3-30B-A3B's layer
shape with fewer layers, random weights, bf16 + Adam, against a dense model of the same active size.

Shape: hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of intermediate 768, top-8
(renormalised), untied 151,936 vocabulary, as many layers as the GPU holds, at most 6 (`layers_that_fit`:
each layer is 0.62B parameters, the embedding and the LM head 0.62B together, at 18 bytes each with
Megatron's bf16 weights, fp32 gradients, fp32 master weights and Adam moments; 6 layers = 4.4B
parameters = 79 GB plus activations on a 141 GB H200, 4 on an 80 GB H100: 64 GB at its peak there).
The dense model has the same layers, attention and vocabulary, and a SwiGLU MLP of width top-k x the
expert width (8 x 768 = 6144): the parameters a MoE token computes with, bar the router.

- Train step (`MegatronBackend.train_step`, SEQUENCES sequences of 4096 a step, in micro-batches of
  each size of MICROS sequences while they fit): tokens/s, TFLOP/s and
  MFU counted on the ACTIVE parameters (what a token computes): per token and layer, forward
  2 x (QKV + output projection + router + k experts x 3 x hidden x expert intermediate) multiply-adds
  plus attention's QK^T and PV over the causal half ((s + 1) / 2 keys), and the LM head
  2 x hidden x vocab; forward + backward = 3 x forward (`train_flops`). MFU = achieved / 790 TFLOP/s
  (the bf16 matmul rate measured on the H200, docs/measured.md). The step's router losses are logged
  (`moe/aux_loss`: 1.0 is balanced; `moe/z_loss`). Rows: the grouped experts (the default,
  `train.megatron.moe_grouped_gemm`), routed by the model and with routing replay (every token's
  experts given by a record, as an engine would report them), both dispatched by a sort on the device
  (`train.megatron.moe_local_dispatch`); the same with Megatron's all-to-all dispatcher (which makes
  the host wait for the GPU in every layer); Megatron's SequentialMLP (a Python loop
  over the experts, one step); the dense model. The headline takes the fastest MoE micro-batch size;
  its MoE/dense ratio is tokens/s x active parameters, MoE over dense at that micro-batch size (the
  active sizes differ by the router's 0.1%).
- Engine decode (the embedded engine's `SlotModel`, 32 requests of 128-token prompts, one token each
  per step, the host reading every step's tokens as the engine does): MoE (eager step: grouped experts;
  CUDA-graph step: every expert over every token, zero-weighted off the chosen ones, or the grouped
  experts captured) against the dense model, tokens/s; each MoE step profiled once (GPU ms by kind).

Run: `slime-async bench megatron_moe_gpu`; `--quick` times one step after the warm-up instead of three.
The module constants shrink everything for the CPU smoke test (tests/megatron/test_moe_bench.py).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import Result
from benchmarks.gpu_anchor import profile_note

DESCRIPTION = ("megatron backend on a CUDA GPU, MoE: Qwen3-30B-A3B layers (128 experts, top-8), bf16: "
               "train-step tokens/s and MFU on active parameters (grouped experts, SequentialMLP, a dense model "
               "of the same active size), router losses, routing replay; engine decode MoE vs dense")

CEILING_TFLOPS = 790.0  # bf16 matmul rate measured on the H200 (docs/measured.md)
DEVICE = "cuda"  # module constants, so that the CPU smoke test can shrink everything
TRAIN_DTYPE = "bfloat16"
SEQ = 4096
SEQUENCES = int(os.environ.get("MOE_GPU_SEQUENCES", "16"))
"""Sequences of SEQ tokens a train step. The optimizer updates every parameter (total, not active) once
a step, so MFU on active parameters grows with the tokens a step."""
MICROS = tuple(int(m) for m in os.environ.get("MOE_GPU_MICROS", "1,2,4").split(","))
"""Micro-batch sizes (sequences) of the MoE and dense rows, the smallest first; a size that runs out of
memory is a failed row and ends the list. Each micro-batch adds every expert's bf16 weight gradient into
its fp32 buffer (2.4B parameters at 4 layers: 179 ms of a 1,048 ms step at 16 micro-batches on an
H100), so fewer, larger micro-batches pay that less often."""
LAYERS: int | None = None  # None: `layers_that_fit` the GPU
MAX_LAYERS = 6
BYTES_PER_PARAM = 18  # bf16 weight, fp32 gradient buffer, fp32 master weight, Adam's two fp32 moments
HEADROOM = 0.75  # of the GPU's memory for the above; the rest for activations, logits and the allocator
CONCURRENCY = 32  # engine decode: requests in flight
PROMPT = 128  # engine decode: prompt tokens per request
DECODE_STEPS = 32  # engine decode: timed steps (after 3 warm-up steps)
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


def _ffn(dense: bool) -> int:
    """Multiply-adds per token of one layer's MLP (and router): k experts, or the dense MLP of width k x expert."""
    h, k, inter = SHAPE["hidden_size"], SHAPE["num_experts_per_tok"], SHAPE["moe_intermediate_size"]
    return k * 3 * h * inter + (0 if dense else h * SHAPE["num_experts"])


def train_flops(seq: int, sequences: int, layers: int, dense: bool = False) -> float:
    """FLOPs of one train step (forward + backward) over `sequences` rows of `seq` tokens, counting the
    parameters each token is routed through (the active ones), not all experts; `dense`: the dense model."""
    h, heads, kv, hd = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], \
        SHAPE["head_dim"]
    q, kvd = heads * hd, kv * hd
    per_layer = h * (q + 2 * kvd) + q * h + _ffn(dense)
    matmul = 2 * layers * per_layer + 2 * h * SHAPE["vocab_size"]
    attention = 2 * 2 * layers * q * (seq + 1) / 2
    return 3 * (matmul + attention) * seq * sequences


def active_params(layers: int, dense: bool = False) -> int:
    """Parameters a token computes with: attention, router, k experts per layer, and the LM head (`dense`:
    the dense model's, no router)."""
    h, q, kvd = SHAPE["hidden_size"], SHAPE["num_attention_heads"] * SHAPE["head_dim"], \
        SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    return layers * (h * (q + 2 * kvd) + q * h + _ffn(dense)) + h * SHAPE["vocab_size"]


def decode_weight_bytes(layers: int, dense: bool = False) -> float:
    """Bytes of weights one decode step of CONCURRENCY tokens reads at the least (bf16): every layer's
    attention, and its MLP: the dense one, or the router and each expert that at least one token picks
    (k of E each, uniformly: E x (1 - (1 - k/E)^tokens) experts expected), and the LM head. Decode at a
    few dozen requests is bound by this traffic: MoE's read per step, over the dense model's, is what a
    MoE step costs more at the least."""
    h, q, kvd = SHAPE["hidden_size"], SHAPE["num_attention_heads"] * SHAPE["head_dim"], \
        SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    e, k, inter = SHAPE["num_experts"], SHAPE["num_experts_per_tok"], SHAPE["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** CONCURRENCY)
    mlp = 3 * h * k * inter if dense else h * e + touched * 3 * h * inter
    return 2.0 * (layers * (h * (q + 2 * kvd) + q * h + mlp) + h * SHAPE["vocab_size"])


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "router_aux_loss_coef")


def _make_model(out: Path, layers: int, dense: bool = False) -> int:
    """Save a random model (the MoE, or `dense`: Qwen3 with an MLP of width k x expert) to `out`; its parameters."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if dense:
        width = SHAPE["num_experts_per_tok"] * SHAPE["moe_intermediate_size"]
        fields = {k: v for k, v in SHAPE.items() if k not in _MOE_FIELDS}
        config = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=SEQ, **{**fields,
                                                                                      "intermediate_size": width})
    else:
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


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


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
    the GPU waited for the host."""
    from benchmarks.gpu_anchor import kernel_breakdown
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
    _add(rows, ["step profile (GPU ms)", micro_key("routed by the model", be.micro_batch_size), "", "", "",
                 prof["wall_s"] * 1e3, "",
                 profile_note(prof)])


def _train_rows(be: Any, cases: list[tuple[str, Any]], flops: float, steps: int, rows: list, details: dict
                ) -> bool:
    """Time `be`'s train step on each (row name, batch) of `cases`; a failure is a row, not the end.
    Whether every case ran."""
    tokens = SEQUENCES * SEQ
    ok = True
    for key, b in cases:
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            step_s, metrics = _time_steps(be, b, steps)
        except Exception:  # keep going: the other rows still report
            details["errors"][key] = traceback.format_exc()
            print(details["errors"][key], flush=True)
            _add(rows, ["train step", key, "failed", "", "", "", "", traceback.format_exc(limit=1)[-200:]])
            ok = False
            _free()  # what the failed step held (out of memory, say) goes back before the next row
            continue
        tflops = flops / step_s / 1e12
        peak = torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0
        note = ""
        if "moe/aux_loss" in metrics:
            note = f"aux {metrics['moe/aux_loss']:.4f}, z {metrics.get('moe/z_loss', float('nan')):.3g}" + (
                f", route mismatch {metrics['moe/route_mismatch']:.2f}" if "moe/route_mismatch" in metrics else "")
        _add(rows, ["train step", key, tokens / step_s, tflops, 100 * tflops / CEILING_TFLOPS, step_s * 1e3, peak,
                     note])
        details["train"][key] = {"step_s": step_s, "tokens": tokens, "tflops": tflops, "tok_s": tokens / step_s,
                                 "mfu": tflops / CEILING_TFLOPS, "peak_gb": peak, "metrics": metrics,
                                 "micro_batch": be.micro_batch_size}
    return ok


def micro_key(base: str, micro: int) -> str:
    """A row's name at micro-batch size `micro` (size 1 keeps the plain name)."""
    return base if micro == 1 else f"{base}, micro-batch {micro}"


def _micro_rows(be: Any, base: str, batch: Any, flops: float, steps: int, rows: list, details: dict,
                extra: list[tuple[str, Any]] | None = None) -> None:
    """`be`'s train step at each micro-batch size of MICROS until one fails (out of memory); `extra` rows
    at the first size."""
    for i, micro in enumerate(MICROS):
        be.micro_batch_size = micro
        cases = [(micro_key(base, micro), batch), *((extra or []) if i == 0 else [])]
        if not _train_rows(be, cases, flops, steps, rows, details):
            break


def _kernel(be: Any) -> str:
    """What the grouped experts of every layer run: torch's grouped GEMM, or (a weight it refuses) the
    per-expert fallback."""
    from slime_async.moe.experts import can_group

    ok = True
    for layer in be.module.decoder.layers:
        for w in (layer.mlp.experts.weight1, layer.mlp.experts.weight2):
            ok &= can_group(torch.zeros(16, w.shape[-1], dtype=w.dtype, device=w.device), w.detach().transpose(1, 2))
    return "torch._grouped_mm" if ok else "per-expert fallback"


def _backend(model_dir: Path, grouped: bool = True, local_dispatch: bool = True) -> Any:
    from slime_async.config.schema import MegatronConfig
    from slime_async.train.backend import OptimizerSettings
    from slime_async.train.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, device=DEVICE, dtype=TRAIN_DTYPE, micro_batch_size=1,  # type: ignore[arg-type]
                           optim=OptimizerSettings(lr=1e-5),
                           parallel=MegatronConfig(moe_grouped_gemm=grouped, moe_local_dispatch=local_dispatch))


DECODE_MODES: dict[str, tuple[bool, str]] = {
    "eager step": (False, "dense"),
    "CUDA-graph step": (True, "dense"),
    "CUDA-graph step, grouped experts": (True, "grouped"),
}
"""Decode rows: (recorded CUDA graph, `SlotModel.graph_experts`). The eager step always runs the grouped
(sparse) experts; a graph runs `dense` (every expert over every token, zero-weighted) or `grouped` (the
same grouped matmuls, captured). A dense model has no experts: only the first two apply."""


def decode_rates(model_dir: Path, moe: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """(engine decode tokens/s of each mode of DECODE_MODES, one profiled step of each): CONCURRENCY
    requests of PROMPT tokens prefilled, then DECODE_STEPS steps of one token each (after 3 warm-up
    steps), each step's tokens read on the host as the engine does."""
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu_anchor import kernel_breakdown
    from slime_async.engine.graphs import CudaCapture, EagerDecoder, GraphDecoder, eager_capture
    from slime_async.engine.model import SlotModel

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, TRAIN_DTYPE)).to(DEVICE).eval()
    length = PROMPT + DECODE_STEPS + 8
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, SHAPE["vocab_size"], (CONCURRENCY, PROMPT), generator=g).tolist()
    rates, profiles = {}, {}
    for mode, (graphs, experts) in DECODE_MODES.items():
        if experts == "grouped" and not moe:
            continue
        slots = SlotModel(model, max_slots=CONCURRENCY, max_len=length, initial_len=length, graph_experts=experts)  # type: ignore[arg-type]
        decoder: Any = (GraphDecoder(slots, CudaCapture() if DEVICE == "cuda" else eager_capture,
                                     buckets=[CONCURRENCY]) if graphs else EagerDecoder(slots))
        tokens = slots.prefill_batch(0, prompts).argmax(-1).tolist()
        positions = [PROMPT] * CONCURRENCY
        began = 0.0
        for i in range(3 + DECODE_STEPS):
            if i == 3:
                _sync()
                began = time.perf_counter()
            tokens = decoder.decode(tokens, positions, record=True).argmax(-1).tolist()
            positions = [p + 1 for p in positions]
        rates[mode] = CONCURRENCY * DECODE_STEPS / (time.perf_counter() - began)
        if moe:  # where a MoE step's time goes (the same positions again: only the cache rows are rewritten)
            try:
                step = functools.partial(decoder.decode, tokens, positions, record=True)
                profiles[mode] = kernel_breakdown(step, DEVICE, top=8)
            except Exception:  # the rate stands without it
                profiles[mode] = {"error": traceback.format_exc(limit=2)}
        decoder.release()
        del decoder, slots
    del model
    _free()
    return rates, profiles


def _engine_rows(moe_dir: Path, dense_dir: Path, rows: list, details: dict) -> None:
    for model, path in (("MoE", moe_dir), ("dense", dense_dir)):
        try:
            rates, profiles = decode_rates(path, moe=model == "MoE")
        except Exception:
            details["errors"][f"decode {model}"] = traceback.format_exc()
            print(details["errors"][f"decode {model}"], flush=True)
            _add(rows, [f"engine decode, {CONCURRENCY} requests", model, "failed", "", "", "", "",
                        traceback.format_exc(limit=1)[-200:]])
            continue
        for mode, rate in rates.items():
            key = f"{model}, {mode}"
            details["decode"][key] = rate
            prof = profiles.get(mode, {})
            note = f"{PROMPT}-token prompts" + (f"; GPU ms: {profile_note(prof)}" if "wall_s" in prof else "")
            if prof:
                details.setdefault("decode_profile", {})[key] = prof
            _add(rows, [f"engine decode, {CONCURRENCY} requests", key, rate, "", "", 1e3 * CONCURRENCY / rate, "",
                        note])


def _add(rows: list, row: list) -> None:
    """Append a table row and print it at once (a run cut short still shows what it measured)."""
    rows.append(row)
    print("row:", row, flush=True)


PHASES = ("grouped", "alltoall", "sequential", "dense", "engine")
"""Each in its own process: Megatron keeps global state (parallel groups, buffers) that holds GPU memory
after its backend is dropped, and an H100 holds one 4-layer MoE with its optimizer state, not two (the
SequentialMLP and dense rows ran out of memory in one process after the grouped one)."""
_CONSTANTS = ("DEVICE", "TRAIN_DTYPE", "SEQ", "SEQUENCES", "MICROS", "LAYERS", "SHAPE", "CONCURRENCY", "PROMPT",
              "DECODE_STEPS")
"""The module constants a phase's process takes from its parent (the CPU test shrinks them)."""


def run(quick: bool = False) -> Result:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("megatron_moe_gpu needs a CUDA GPU")
    layers = LAYERS or layers_that_fit(torch.cuda.get_device_properties(0).total_memory)
    rows: list[list[Any]] = []
    details: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                               "shape": {**SHAPE, "num_hidden_layers": layers}, "seq": SEQ, "sequences": SEQUENCES,
                               "ceiling_tflops": CEILING_TFLOPS, "active_params": active_params(layers),
                               "dense_active_params": active_params(layers, dense=True),
                               "flops_per_step": train_flops(SEQ, SEQUENCES, layers), "train": {}, "decode": {},
                               "decode_weight_bytes": {"MoE": decode_weight_bytes(layers),
                                                       "dense": decode_weight_bytes(layers, dense=True)},
                               "errors": {}}
    steps = 1 if quick else 3
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir = Path(tmp) / "moe", Path(tmp) / "dense"
        details["params"] = _make_model(moe_dir, layers)
        details["dense_params"] = _make_model(dense_dir, layers, dense=True)
        details["make_model_s"] = time.perf_counter() - began
        _free()
        for name in PHASES:
            _phase_in_process(name, Path(tmp), layers, steps, rows, details)
    details["seconds"] = time.perf_counter() - began
    return Result(
        columns=["what", "config", "tok/s", "TFLOP/s (active)", "MFU %", "ms", "peak GB", "note"],
        rows=rows, headline=_headline(layers, details), details=details,
    )


def _phase_in_process(name: str, tmp: Path, layers: int, steps: int, rows: list, details: dict) -> None:
    """Run phase `name` in a process of its own (`python -m benchmarks.megatron_moe_gpu PHASE_FILE`) and
    merge its rows and figures; one that dies is a row and an error, and the next phase still runs."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"phase": name, "dir": str(tmp), "layers": layers, "steps": steps,
                                "constants": {k: globals()[k] for k in _CONSTANTS}}))
    done = subprocess.run([sys.executable, "-m", "benchmarks.megatron_moe_gpu", str(spec)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    out = spec.with_suffix(".out.json")
    if done.returncode != 0 or not out.exists():
        details["errors"][name] = f"exit {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
        print(details["errors"][name], flush=True)
        _add(rows, ["phase", name, "failed", "", "", "", "", f"exit {done.returncode}"])
        return
    part = json.loads(out.read_text())
    rows += part["rows"]
    for key, value in part["details"].items():
        if isinstance(value, dict) and isinstance(details.get(key), dict):
            details[key].update(value)
        else:
            details[key] = value


def _phase(name: str, tmp: Path, layers: int, steps: int) -> tuple[list, dict]:
    """One phase, in this (its own) process: its rows and figures."""
    from benchmarks.megatron_gpu import _batch

    rows: list[list[Any]] = []
    details: dict[str, Any] = {"train": {}, "decode": {}, "errors": {}}
    moe_dir, dense_dir = tmp / "moe", tmp / "dense"
    batch = _batch(SEQUENCES, SEQ, SHAPE["vocab_size"])
    moe_flops, dense_flops = train_flops(SEQ, SEQUENCES, layers), train_flops(SEQ, SEQUENCES, layers, dense=True)
    try:
        if name == "grouped":
            began = time.perf_counter()
            be = _backend(moe_dir)
            details["build_s"] = time.perf_counter() - began
            details["grouped_kernel"] = _kernel(be)
            print("grouped experts run", details["grouped_kernel"], flush=True)
            _micro_rows(be, "routed by the model", batch, moe_flops, steps, rows, details,
                        extra=[("routing replay", _replayed(batch, layers))])
            ran = [details["train"][micro_key("routed by the model", m)] for m in MICROS
                   if micro_key("routed by the model", m) in details["train"]]
            if ran:  # the profile at the fastest size
                be.micro_batch_size = min(ran, key=lambda r: r["step_s"])["micro_batch"]
                _profile(be, batch, rows, details)
        elif name == "alltoall":
            _train_rows(_backend(moe_dir, local_dispatch=False),
                        [("grouped, Megatron's all-to-all dispatcher", batch)], moe_flops, steps, rows, details)
        elif name == "sequential":
            _train_rows(_backend(moe_dir, grouped=False), [("SequentialMLP, routed by the model", batch)], moe_flops,
                        1, rows, details)
        elif name == "dense":
            _micro_rows(_backend(dense_dir), "dense, same active parameters", batch, dense_flops, steps, rows,
                        details)
        else:
            _engine_rows(moe_dir, dense_dir, rows, details)
    except Exception:  # a backend that cannot be built: said, and the other phases still run
        details["errors"][name] = traceback.format_exc()
        print(details["errors"][name], flush=True)
        _add(rows, ["train step", name, "failed", "", "", "", "", traceback.format_exc(limit=1)[-200:]])
    return rows, details


def _phase_main(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    globals().update(spec["constants"])  # the parent's constants (the CPU test shrinks them)
    rows, details = _phase(spec["phase"], Path(spec["dir"]), spec["layers"], spec["steps"])
    spec_path.with_suffix(".out.json").write_text(json.dumps({"rows": rows, "details": details}, default=float))


def _headline(layers: int, details: dict[str, Any]) -> str:
    nan = float("nan")
    train, decode = details["train"], details["decode"]
    seq = train.get("SequentialMLP, routed by the model", {})
    moes = {m: train[micro_key("routed by the model", m)] for m in MICROS
            if micro_key("routed by the model", m) in train}
    micro = max(moes, key=lambda m: moes[m]["tok_s"], default=1)
    moe, moe1 = moes.get(micro, {}), moes.get(1, {})
    dense = train.get(micro_key("dense, same active parameters", micro), {})
    alltoall = train.get("grouped, Megatron's all-to-all dispatcher", {})
    per_param = (moe.get("tok_s", nan) * details["active_params"]) / (
        dense.get("tok_s", nan) * details["dense_active_params"])
    traffic = details["decode_weight_bytes"]
    ratio = traffic["MoE"] / traffic["dense"]
    moe_decode = max((v for k, v in decode.items() if k.startswith("MoE")), default=nan)
    dense_decode = max((v for k, v in decode.items() if k.startswith("dense")), default=nan)
    return (f"MoE train step ({layers} Qwen3-30B-A3B layers, {details['params'] / 1e9:.2f}B params, "
            f"{details['active_params'] / 1e9:.2f}B active, {SEQUENCES} x {SEQ} tokens a step in micro-batches of "
            f"{micro}): {moe.get('tflops', nan):.0f} TFLOP/s = "
            f"{100 * moe.get('mfu', nan):.1f}% MFU on active parameters (goal >= 35%), "
            f"at micro-batch 1 {moe1.get('tok_s', nan) / alltoall.get('tok_s', nan):.2f}x Megatron's all-to-all "
            f"dispatcher and {moe1.get('tok_s', nan) / seq.get('tok_s', nan):.1f}x SequentialMLP; tokens/s "
            f"x active parameters "
            f"MoE/dense {per_param:.2f}x (goal >= 0.7x); engine decode at {CONCURRENCY} requests MoE/dense "
            f"{moe_decode / dense_decode:.2f}x tokens/s (the faster step of each; goal >= 0.5x: within 2x; the "
            f"MoE step reads {ratio:.1f}x the dense step's weight bytes)")


if __name__ == "__main__":  # one phase in its own process (`_phase_in_process`)
    _phase_main(Path(sys.argv[1]))
