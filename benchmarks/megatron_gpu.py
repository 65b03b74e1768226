"""The Megatron backend on one CUDA GPU (issue 9): a ~1.2B Qwen2-shaped random model, bf16, sequences of 4096.

- Train step (`MegatronBackend.train_step`: forward, backward, Megatron DDP + distributed optimizer
  step) on 8 sequences x 4096 tokens, by micro-batch size and core attention (`sdpa`: torch SDPA,
  flash kernels; `local`: Megatron's unfused attention, for comparison): tokens/s, TFLOP/s and MFU.
  FLOPs are counted, not measured: 2 per multiply-add of every matmul (QKV, output, MLP, LM head),
  plus attention's QK^T and PV over the causal half (the (s + 1) / 2 keys a query sees on average);
  forward + backward = 3 x forward. MFU = achieved / 790 TFLOP/s, the bf16 matmul rate measured on
  this GPU (docs/measured.md).
- Logprob parity with the torch backend on the same GPU and weights: float32 against float32
  (tight), bf16 (Megatron mixed precision) against bf16 (torch autocast); and one float32 train step:
  loss and gradient norm of both backends.
- Weight export: every tensor of `named_weights()` (HF names, bf16) copied in place into a colocated
  bf16 HF model, as an engine on the same GPU would take it, against the copy bound (the weights'
  bytes read and written at the measured device-to-device copy bandwidth); then that model's logprobs
  against the trainer's (the export is right after training steps, not only at load).
- Issue 30: the plain HF train step on the same GPU, shape and batch (`gpu_anchor`; the headline is
  Megatron's ratio to it at micro-batch 2), one step of each under torch's profiler by kernel
  category, and the step at micro-batch 2 without two of the backend's GPU fusions: compiled logprobs
  (`train.megatron.fused_logprobs`) and weight gradients accumulated into the float32 buffers by the
  GEMM (`train.megatron.wgrad_fusion`; plus one step with and without it from the same weights: their
  gradient norms).

Run: `slime-async bench megatron_gpu` (or `python -m slime_async.cli bench megatron_gpu`); `--quick`
skips the unfused-attention comparison and the largest micro-batch.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import Result

DESCRIPTION = ("megatron backend on a CUDA GPU: ~1.2B Qwen2-shaped model, bf16, seq 4096: train-step MFU, "
               "logprob parity with the torch backend, weight export vs the copy bound")

CEILING_TFLOPS = 790.0  # bf16 matmul rate measured on the H200 (docs/measured.md)
SEQ = 4096
BUDGET_S = 420  # phases starting later are skipped: one device command may run 600 s, set-up included
SEQUENCES = 8
# Qwen2.5-3B's layer shape (hidden 2048, MLP 11008, 16 heads, 2 key/value heads, tied 151,936 vocab)
# with 12 layers: 1.24B parameters, 0.93B of them outside the embedding
DEVICE = "cuda"  # module constants, so that a CPU smoke run can shrink everything (tests never do)
TRAIN_DTYPE = "bfloat16"
SHAPE = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=SEQ,
             rms_norm_eps=1e-6)


def train_flops(seq: int, sequences: int) -> float:
    """FLOPs of one train step (forward + backward) over `sequences` rows of `seq` tokens."""
    h, layers, vocab, ffn = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["vocab_size"], \
        SHAPE["intermediate_size"]
    hd = h // SHAPE["num_attention_heads"]
    q, kv = SHAPE["num_attention_heads"] * hd, SHAPE["num_key_value_heads"] * hd
    matmul = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * ffn) + 2 * h * vocab
    attention = 2 * 2 * layers * q * (seq + 1) / 2
    return 3 * (matmul + attention) * seq * sequences


def _batch(n: int, tokens: int, vocab: int, seed: int = 0) -> Any:
    from slime_async.train.batch import build_batch
    from slime_async.train.synthetic import make_trajectories

    trajs = make_trajectories(n, group_size=4, seed=seed, vocab=vocab, tokens=tokens, logprob=-12.0)
    return build_batch(trajs, max_seq_len=tokens).batch


def _make_model(out: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPE)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, TRAIN_DTYPE))
    model.save_pretrained(out)
    del model


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (best of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        _sync()
        t = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _objective() -> Any:
    from slime_async.config.schema import TrainConfig
    from slime_async.train.objective import Objective

    return Objective(TrainConfig(loss="grpo"))


def _time_steps(be: Any, batch: Any, steps: int) -> tuple[float, float]:
    """(median train-step seconds, median logprob-recompute seconds) after one warm-up."""
    obj = _objective()
    step_s, fwd_s = [], []
    for i in range(steps + 1):
        _sync()
        t0 = time.perf_counter()
        prox = be.logprobs(batch, 1.0).logprobs
        _sync()
        t1 = time.perf_counter()
        result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0)
        _sync()
        t2 = time.perf_counter()
        if not result.applied:
            raise RuntimeError(f"train step not applied: {result.reason}")
        if i:
            fwd_s.append(t1 - t0)
            step_s.append(t2 - t1)
    return statistics.median(step_s), statistics.median(fwd_s)


def _attention_kernels(rows: list, details: dict) -> None:
    """Causal GQA attention alone at the model's shape (fwd + bwd), as SDPA picks its kernel and with
    flash forced: says whether the train step's attention runs on a fused kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv, hd = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], \
        SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    q = torch.randn(2, heads, SEQ, hd, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, kv, SEQ, hd, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    flops = 3 * 2 * 2 * 2 * heads * hd * SEQ * (SEQ + 1) / 2  # fwd + bwd, causal half, batch 2
    for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION])):
        try:
            times = []
            for _ in range(6):
                _sync()
                t = time.perf_counter()
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    out.sum().backward()
                _sync()
                times.append(time.perf_counter() - t)
            seconds = statistics.median(times[1:])
            rows.append(["attention fwd+bwd", f"SDPA {name}", "", flops / seconds / 1e12, "", seconds * 1e3, "",
                         f"2 x {SEQ} tokens, {heads}/{kv} heads of {hd}"])
            details.setdefault("attention", {})[name] = {"seconds": seconds, "tflops": flops / seconds / 1e12}
        except Exception as exc:  # a kernel that refuses these inputs is a finding, not a failure
            rows.append(["attention fwd+bwd", f"SDPA {name}", "", "", "", "", "", f"refused: {exc}"[:200]])


def _megatron(model_dir: Path, dtype: str, attention: str, micro: int, lr: float = 1e-5, fused: bool = True,
              wgrad: bool = True) -> Any:
    from slime_async.config.schema import MegatronConfig
    from slime_async.train.backend import OptimizerSettings
    from slime_async.train.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, device=DEVICE, dtype=dtype, micro_batch_size=micro,
                           optim=OptimizerSettings(lr=lr),  # type: ignore[arg-type]
                           parallel=MegatronConfig(attention=attention, fused_logprobs=fused,  # type: ignore[arg-type]
                                                   wgrad_fusion=wgrad))


def _throughput(model_dir: Path, attention: str, micros: list[int], steps: int, rows: list, details: dict,
                fused: bool = True, wgrad: bool = True) -> Any:
    """Train-step rows for `attention`; returns the backend (kept for the export phase) or None."""
    batch = _batch(SEQUENCES, SEQ, SHAPE["vocab_size"])
    flops = train_flops(SEQ, SEQUENCES)
    be = _megatron(model_dir, TRAIN_DTYPE, attention, micros[0], fused=fused, wgrad=wgrad)
    if wgrad:
        details["wgrad_fusion"] = be.config.gradient_accumulation_fusion
    for micro in micros:
        key = f"{attention}/mb{micro}" + ("" if fused else " unfused logprobs") + ("" if wgrad else " unfused wgrad")
        be.micro_batch_size = micro
        _free()
        try:
            step_s, fwd_s = _time_steps(be, batch, steps)
        except torch.OutOfMemoryError:
            rows.append(["train step", key, "OOM", "", "", "", "", ""])
            details["train"][key] = "out of memory"
            _free()
            continue
        tflops = flops / step_s / 1e12
        peak = _peak_gb()
        tokens = SEQUENCES * SEQ
        rows.append(["train step", key, tokens / step_s, tflops, 100 * tflops / CEILING_TFLOPS, step_s * 1e3, peak,
                     f"recompute {tokens / fwd_s:,.0f} tok/s"])
        details["train"][key] = {"step_s": step_s, "recompute_s": fwd_s, "tokens": tokens, "tflops": tflops,
                                 "mfu": tflops / CEILING_TFLOPS, "peak_gb": peak, "flops_per_step": flops}
    return be


def _export(be: Any, model_dir: Path, rows: list, details: dict) -> None:
    """In-place copy of every exported tensor into a colocated bf16 HF model, vs the copy bound."""
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=be.export_dtype).to(DEVICE).eval()
    params = dict(engine.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    bandwidth = _copy_bandwidth()
    times = []
    for _ in range(4):
        _sync()
        t = time.perf_counter()
        with torch.no_grad():
            for name, tensor in be.named_weights():
                params[name].copy_(tensor)
        _sync()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times[1:])
    bound = 2 * nbytes / bandwidth
    rows.append(["weight export + in-place copy", f"{nbytes / 1e9:.2f} GB {TRAIN_DTYPE}", seconds * 1e3, "", "", "", "",
                 f"{seconds / bound:.1f}x the copy bound ({bound * 1e3:.2f} ms at {bandwidth / 1e9:,.0f} GB/s)"])
    details["export"] = {"seconds": times, "bytes": nbytes, "copy_GBps": bandwidth / 1e9, "copy_bound_s": bound,
                         "x_bound": seconds / bound}
    # the engine now holds the trained weights: its logprobs must be the trainer's (bf16 rounding apart)
    batch = _batch(2, 1024, SHAPE["vocab_size"], seed=1)
    mine = be.logprobs(batch, 1.0).logprobs
    with torch.no_grad():
        ids = batch.input_ids.to(DEVICE)
        logits = engine(input_ids=ids).logits[:, :-1].float()
        theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
    diff = (mine[:, 1:] - theirs).abs()
    rows.append(["engine after export vs trainer logprobs", TRAIN_DTYPE, float(diff.max()), "", "", "", "",
                 f"mean |Δ| {float(diff.mean()):.2e}"])
    details["export"]["engine_logprob_max_abs_diff"] = float(diff.max())
    del engine


def _parity(model_dir: Path, rows: list, details: dict) -> None:
    """Megatron vs torch backend logprobs (fp32 and bf16) and one fp32 train step."""
    from slime_async.train.backend import OptimizerSettings
    from slime_async.train.torch_backend import TorchBackend

    batch = _batch(2, SEQ, SHAPE["vocab_size"], seed=2)
    for dtype in ("float32", TRAIN_DTYPE) if TRAIN_DTYPE != "float32" else ("float32",):
        mega = _megatron(model_dir, dtype, "sdpa", 1)
        got = mega.logprobs(batch, 1.0).logprobs
        result_m = None
        if dtype == "float32":
            obj = _objective()
            result_m = mega.train_step(batch, obj.loss_fn(obj.prepare(batch, got)), 1.0)
        del mega
        _free()
        ref = TorchBackend(model_dir, device=DEVICE, dtype=dtype, micro_batch_size=1,
                           optim=OptimizerSettings(lr=1e-5))  # type: ignore[arg-type]
        want = ref.logprobs(batch, 1.0).logprobs
        mask = batch.loss_mask.bool()
        diff = (got - want)[mask].abs()
        rows.append(["logprobs vs torch backend", dtype, float(diff.max()), "", "", "", "",
                     f"mean |Δ| {float(diff.mean()):.2e} over {int(mask.sum())} tokens"])
        details["parity"][dtype] = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}
        if result_m is not None:
            obj = _objective()
            result_t = ref.train_step(batch, obj.loss_fn(obj.prepare(batch, want)), 1.0)
            rel_loss = abs(result_m.loss - result_t.loss) / max(abs(result_t.loss), 1e-12)
            rel_norm = abs(result_m.grad_norm - result_t.grad_norm) / max(result_t.grad_norm, 1e-12)
            rows.append(["fp32 train step vs torch backend", "loss, grad norm", rel_loss, "", "", "", "",
                         f"relative diffs: loss {rel_loss:.1e}, grad norm {rel_norm:.1e} "
                         f"({result_m.grad_norm:.4g} vs {result_t.grad_norm:.4g})"])
            details["parity"]["train_step"] = {"megatron": [result_m.loss, result_m.grad_norm],
                                               "torch": [result_t.loss, result_t.grad_norm]}
        del ref
        _free()


def _wgrad_check(model_dir: Path, rows: list, details: dict) -> None:
    """One bf16 train step at micro-batch 2 from the same weights on the same batch, with the weight
    gradients accumulated by the fused GEMM into the float32 buffers and without (bf16 gradients added
    to them): the loss must agree and the gradient norms closely (the fused one rounds less)."""
    batch = _batch(SEQUENCES, SEQ, SHAPE["vocab_size"])
    obj = _objective()
    out = {}
    for fused in (True, False):
        be = _megatron(model_dir, TRAIN_DTYPE, "sdpa", 2, wgrad=fused)
        used = be.config.gradient_accumulation_fusion
        result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0)
        out[fused] = (result.loss, result.grad_norm, used)
        del be
        _free()
    (loss_f, norm_f, used), (loss_u, norm_u, _) = out[True], out[False]
    rel = abs(norm_f - norm_u) / max(norm_u, 1e-12)
    rows.append([f"{TRAIN_DTYPE} step, fused vs unfused weight gradients", "grad norm", rel, "", "", "", "",
                 f"relative diff; grad norm {norm_f:.5g} vs {norm_u:.5g}, loss {loss_f:.6g} vs {loss_u:.6g}"
                 + ("" if used else " (fusion NOT in use: its GEMM check failed)")])
    details["wgrad_check"] = {"fused": out[True], "unfused": out[False], "grad_norm_rel_diff": rel}


def _checkpoint(tmp: Path, rows: list, details: dict) -> None:
    """Save and load on the GPU path (Megatron DDP, distributed optimizer, bf16 with fp32 master weights),
    on a small model: a loaded backend must continue exactly as the one that saved."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    small = tmp / "small"
    config = Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(small)
    batch = _batch(4, 256, 1000, seed=3)
    obj = _objective()

    def step(be: Any) -> None:
        assert be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0).applied

    a = _megatron(small, TRAIN_DTYPE, "sdpa", 2, lr=1e-3)
    step(a)
    a.save(tmp / "ck")
    b = _megatron(small, TRAIN_DTYPE, "sdpa", 2, lr=1e-3)
    b.load(tmp / "ck")
    for be in (a, b):
        step(be)
    same = all(torch.equal(p, q) for (_, p), (_, q) in zip(a.named_weights(), b.named_weights(), strict=True))
    moved = sum(not torch.equal(p, q) for (_, p), (_, q) in zip(
        a.named_weights(), _megatron(small, TRAIN_DTYPE, "sdpa", 2).named_weights(), strict=True))
    rows.append(["checkpoint save/load, one more step", f"small model, {TRAIN_DTYPE}", int(same), "", "", "", "",
                 f"1 = weights identical after resuming ({moved} tensors moved from the start)"])
    details["checkpoint"] = {"identical_after_resume": same, "tensors_moved": moved}


def run(quick: bool = False) -> Result:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("megatron_gpu needs a CUDA GPU")
    try:
        import megatron.core
    except ImportError as exc:
        raise SystemExit(f"megatron_gpu needs megatron-core (carry its cp312 wheel): {exc}") from None
    rows: list[list[Any]] = []
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    details: dict[str, Any] = {"device": device, "torch": torch.__version__, "shape": SHAPE, "seq": SEQ,
                               "sequences": SEQUENCES, "ceiling_tflops": CEILING_TFLOPS,
                               "train": {}, "parity": {}, "errors": {}}
    details["megatron_core"] = getattr(megatron.core, "__version__", "?")
    steps = 2 if quick else 3
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        _make_model(model_dir)
        details["make_model_s"] = time.perf_counter() - began
        details["params"] = sum(int(np.prod(p)) for p in _param_shapes(model_dir))

        def sdpa() -> None:  # the backend is freed before the HF model comes (an H100 has 80 GB)
            be = _throughput(model_dir, "sdpa", [1, 2] if quick else [1, 2, 4], steps, rows, details)
            _export(be, model_dir, rows, details)
            _profile("megatron/mb2", lambda batch, obj: _megatron_step(be, batch, obj), rows, details)

        def anchor() -> None:
            from benchmarks.gpu_anchor import hf_step

            _anchor(model_dir, [1, 2] if quick else [1, 2, 4], steps, rows, details)
            _free()
            _profile("hf/mb2", lambda batch, obj: hf_step(model_dir, batch, 2, DEVICE), rows, details)

        phases = [("attention kernels", lambda: _attention_kernels(rows, details)),
                  ("sdpa train steps, export, profile", sdpa),
                  ("plain HF anchor, profile", anchor),
                  ("unfused logprobs (before issue 30)",
                   lambda: _throughput(model_dir, "sdpa", [2], steps, rows, details, fused=False)),
                  ("unfused weight gradients",
                   lambda: _throughput(model_dir, "sdpa", [2], steps, rows, details, wgrad=False)),
                  ("weight-gradient fusion: one step against the unfused one", lambda: _wgrad_check(model_dir, rows,
                                                                                                   details)),
                  ("parity with the torch backend", lambda: _parity(model_dir, rows, details)),
                  ("checkpoint resume", lambda: _checkpoint(Path(tmp), rows, details))]
        if not quick:  # last: a comparison, the first to go when time runs short
            phases.append(("local attention train steps",
                           lambda: _throughput(model_dir, "local", [1, 2], steps, rows, details)))
        for name, phase in phases:
            elapsed = time.perf_counter() - began
            if elapsed > BUDGET_S:
                rows.append([name, "skipped", "", "", "", "", "", f"{elapsed:.0f} s spent of a {BUDGET_S} s budget"])
                continue
            print(f"megatron_gpu: {name} ({elapsed:.0f} s in)", flush=True)
            try:
                phase()
            except Exception:  # keep going: later phases still report
                details["errors"][name] = traceback.format_exc()
                print(details["errors"][name], flush=True)
                rows.append([name, "failed", "", "", "", "", "", traceback.format_exc(limit=1).strip()[-200:]])
            _free()
    details["seconds"] = time.perf_counter() - began
    return Result(
        columns=["what", "config", "tok/s or value", "TFLOP/s", "MFU %", "ms", "peak GB", "note"],
        rows=rows,
        headline=_headline(details),
        details=details,
    )


def _headline(details: dict[str, Any]) -> str:
    """Megatron against the plain HF step at micro-batch 2 (the issue's goal: 1.15x), and the export."""
    mine, anchor = details["train"].get("sdpa/mb2"), details.get("anchor", {}).get("2")
    ratio = (anchor["step_s"] / mine["step_s"]) if isinstance(mine, dict) and anchor and "step_s" in anchor \
        else float("nan")
    x_bound = details.get("export", {}).get("x_bound", float("nan"))
    return (f"Megatron / plain HF train step at micro-batch 2: {ratio:.2f}x (goal 1.15x); weight export "
            f"{x_bound:.1f}x the copy bound (goal 2x)")


def _anchor(model_dir: Path, micros: list[int], steps: int, rows: list, details: dict) -> None:
    """The plain HF step (`gpu_anchor.hf_step_times`) on the same batch, and its ratio to Megatron's."""
    from benchmarks.gpu_anchor import hf_step_times

    flops = train_flops(SEQ, SEQUENCES)
    tokens = SEQUENCES * SEQ
    details["anchor"] = {}
    for micro, result in hf_step_times(model_dir, _batch(SEQUENCES, SEQ, SHAPE["vocab_size"]), micros, steps,
                                       DEVICE).items():
        details["anchor"][str(micro)] = result
        if "step_s" not in result:
            rows.append(["plain HF train step", f"mb{micro}", "OOM", "", "", "", "", ""])
            continue
        step_s = result["step_s"]
        tflops = flops / step_s / 1e12
        mine = details["train"].get(f"sdpa/mb{micro}")
        ratio = f"Megatron {step_s / mine['step_s']:.2f}x this" if isinstance(mine, dict) else ""
        rows.append(["plain HF train step", f"sdpa/mb{micro}", tokens / step_s, tflops,
                     100 * tflops / CEILING_TFLOPS, step_s * 1e3, result["peak_gb"], ratio])


def _megatron_step(be: Any, batch: Any, obj: Any) -> Any:
    """The Megatron backend's train step at micro-batch 2 as a function of nothing (for the profiler)."""
    be.micro_batch_size = 2
    prox = be.logprobs(batch, 1.0).logprobs
    return lambda: be.train_step(batch, obj.loss_fn(obj.prepare(batch, prox)), 1.0)


def _profile(key: str, make_step: Any, rows: list, details: dict) -> None:
    """GPU time of one step by kernel category (`make_step(batch, objective)` gives the step)."""
    from benchmarks.gpu_anchor import kernel_breakdown, profile_note

    prof = kernel_breakdown(make_step(_batch(SEQUENCES, SEQ, SHAPE["vocab_size"]), _objective()), DEVICE, top=20)
    details.setdefault("profile", {})[key] = prof
    rows.append(["step profile (GPU ms)", key, prof["wall_s"] * 1e3, "", "", prof["kernel_s"] * 1e3, "",
                 profile_note(prof)])


def _param_shapes(model_dir: Path) -> list[tuple[int, ...]]:
    from safetensors import safe_open

    shapes = []
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            shapes += [tuple(st.get_slice(k).get_shape()) for k in st.keys()]  # noqa: SIM118
    return shapes
