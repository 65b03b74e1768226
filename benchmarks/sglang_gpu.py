"""Real SGLang on one GPU, driven by our own parts, beside the embedded engine (issue 38).

1. Real `python -m sglang.launch_server` (the command line our launcher builds from
   `configs/sglang_gpu.yaml`, checked by SGLang's own parser first) on a Qwen2-0.5B-shaped model made
   here, then `benchmarks.sglang_checks` against it: our client's recorded tokens, logprobs and
   versions = SGLang's raw replies and its own prompt scoring; abort by rid; failover past a dead
   server; our publisher's in-place push from tensors (CUDA IPC handles) and from disk, with requests
   decoding through it, the weight version after each, and SGLang's logprobs against the trainer's
   after it (bf16); `/flush_cache` once idle.
2. `slime-async rollout` (env, scheduler, client) against that server; each recorded turn's logprobs
   against SGLang's own scoring of the same tokens.
3. Decode tokens/s at 1, 32 and 128 concurrent requests and the wall time of a whole weight push
   (pause, update, continue), real SGLang then the embedded engine on the same GPU and model.
4. `slime-async train configs/sglang_gpu.yaml` for a few steps: the launcher starts SGLang itself, the
   trainer (torch backend, bf16, same GPU) pushes its weights into it after every step.

Everything SGLang said is kept (logs under `$SGLANG_GPU_OUT`, default /tmp/sglang_gpu). Each stage that
fails is recorded with its error and the others still run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import Result
from benchmarks.engine import decode_rate
from benchmarks.sglang_checks import dead_url, prompts, publish_pause, run_checks, score
from slime_async.launch.local import free_port

DESCRIPTION = ("real SGLang on a GPU: our client, rollout, weight push and train against it; decode tok/s and "
               "update pause vs the embedded engine")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sglang_gpu.yaml"
CONCURRENCY = (1, 32, 128)
READY = r"fired up and ready to roll"
PARTS = ("sglang", "embedded", "train")
"""`SGLANG_GPU_PARTS` picks some (comma-separated): a device call lasts at most 10 minutes, so the parts
can run in calls of their own on the same warm machine; each adds to what `$SGLANG_GPU_OUT/partial.json`
holds from the earlier ones."""


def _out() -> Path:
    out = Path(os.environ.get("SGLANG_GPU_OUT", "/tmp/sglang_gpu"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _start_sglang(model_dir: Path, port: int, log: Path):  # -> ChildProcess
    from slime_async.config.loader import load_config
    from slime_async.launch.process import start_process
    from slime_async.launch.sglang_command import preflight, sglang_argv

    cfg = load_config(CONFIG, [f"model.path={model_dir}"])
    argv = sglang_argv(cfg, model_path=str(model_dir), host="127.0.0.1", port=port, index=0, weight_version="0")
    preflight(argv)  # SGLang's own parser
    return start_process("sglang", argv, READY, timeout=400, log_path=log, own_group=True), argv


def _rates(url: str, vocab: int) -> dict[str, float]:
    out = {}
    for c in CONCURRENCY:
        runs = [asyncio.run(decode_rate(url, prompts(c, vocab, seed=c))) for _ in range(2)]
        out[str(c)] = max(runs)
    return out


def _rollout(url: str, model_dir: Path, out: Path) -> dict[str, Any]:
    """`slime-async rollout` against the server; then SGLang scores every recorded turn again."""
    from slime_async.types import Trajectory
    from slime_async.types.codec import from_json

    path = out / "rollout.jsonl"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "slime_async.cli", "rollout", str(CONFIG), f"model.path={model_dir}",
           f"engine.urls=[{url}]", "engine.kind=sglang", "rollout.guard.on_failures=warn", "--out", str(path),
           "--groups", "4", "--split", "train"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    (out / "rollout.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"ok": False, "error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    trajectories = [from_json(line, Trajectory) for line in path.read_text().splitlines() if line.strip()]
    turns = [t for tr in trajectories for t in tr.turns if len(t.completion_ids)]

    async def rescore() -> np.ndarray:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            gaps = []
            for t in turns:
                ids = t.prompt_ids.tolist() + t.completion_ids.tolist()
                scored = await score(session, url, ids, len(t.prompt_ids))
                gaps.append(np.abs(np.asarray(scored) - t.logprobs.astype(np.float64)))
            return np.concatenate(gaps) if gaps else np.zeros(1)

    gap = asyncio.run(rescore())
    return {"ok": len(trajectories) == 4 * 8 and float(gap.max()) < 0.25, "seconds": time.perf_counter() - started,
            "trajectories": len(trajectories), "turns": len(turns),
            "tokens": int(sum(len(t.completion_ids) for t in turns)),
            "versions": sorted({int(v) for t in turns for v in t.versions}),
            "recorded_vs_sglang_scoring_max": float(gap.max()), "recorded_vs_sglang_scoring_mean": float(gap.mean())}


def _train(model_dir: Path, out: Path, steps: int, *overrides: str) -> dict[str, Any]:
    run_dir = out / "train_run"
    cmd = [sys.executable, "-m", "slime_async.cli", "train", str(CONFIG), f"model.path={model_dir}",
           f"train.steps={steps}", f"run.dir={run_dir}", *overrides, "--overwrite"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    metrics = []
    for f in run_dir.rglob("metrics.jsonl"):
        metrics += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    versions = [m["version"] for m in metrics if "version" in m]
    keep = ("version", "trajectories", "tokens", "seconds", "publish_s", "max_staleness", "max_abs_dp",
            "behav_prox_abs_dlogp", "loss", "grad_norm")
    return {"ok": proc.returncode == 0 and len(versions) >= steps, "exit": proc.returncode,
            "seconds": time.perf_counter() - started, "versions": versions,
            "steps": [{k: m.get(k) for k in keep} for m in metrics],
            "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else ""}


def run(quick: bool = False) -> Result:
    if not torch.cuda.is_available():
        raise SystemExit("sglang_gpu needs a CUDA GPU and SGLang installed (see scripts/gpu_wheels.py)")
    import sglang  # noqa: F401  (fails here, not in a child, if it is missing)
    from transformers import AutoModelForCausalLM

    from slime_async.models.tiny_model import cached_model_dir

    out = _out()
    parts = [p for p in os.environ.get("SGLANG_GPU_PARTS", ",".join(PARTS)).split(",") if p]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"SGLANG_GPU_PARTS: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    model_dir = cached_model_dir("0.5b")
    details: dict[str, Any] = {"stages": {}, "rates": {}, "pauses": {}}
    if set(parts) != set(PARTS) and (out / "partial.json").is_file():  # an earlier call's parts
        details = json.loads((out / "partial.json").read_text())
    details.update({"device": torch.cuda.get_device_name(), "sglang": _version("sglang"), "torch": torch.__version__})
    stages = details["stages"]  # rates: {engine: {concurrency as text (JSON keys): tokens/s}}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    if "sglang" in parts:
        _sglang_part(model_dir, model, vocab, out, details)
    if "embedded" in parts:
        _embedded_part(model_dir, model, vocab, out, details)
    model = None  # the trainer run below needs the memory
    torch.cuda.empty_cache()
    if "train" in parts:
        # the GPU image may lack tensorboard (a dependency of ours, not of the check)
        extra = [] if importlib.util.find_spec("tensorboard") else ["log.tensorboard=false"]
        stages["train"] = _guard(lambda: _train(model_dir, out, 2 if quick else 4, *extra))
        _save(out, details)
    return _result(details)


def _sglang_part(model_dir: Path, model: Any, vocab: int, out: Path, details: dict[str, Any]) -> None:
    """Real SGLang: its start, our checks against it, `slime-async rollout`, decode rates, the push's pause."""
    stages, rates, pauses = details["stages"], details["rates"], details["pauses"]
    port = free_port("127.0.0.1")
    started = time.perf_counter()
    try:
        server, argv = _start_sglang(model_dir, port, out / "sglang.log")
    except Exception as exc:
        stages["start"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
        server = None
    if server is not None:
        url = f"http://127.0.0.1:{port}"
        stages["start"] = {"ok": True, "seconds": time.perf_counter() - started, "argv": argv[2:]}
        try:
            checks = asyncio.run(run_checks(url, model, vocab, dead_url(), out / "disk"))
            stages.update({f"sglang/{k}": v for k, v in checks.items()})
            _save(out, details)
            stages["sglang/rollout"] = _guard(lambda: _rollout(url, model_dir, out))
            _save(out, details)
            rates["sglang"] = _guard_value(lambda: _rates(url, vocab), stages, "sglang/decode")
            p = _guard(lambda: asyncio.run(publish_pause(url, model, 100)))
            stages["sglang/publish_pause"] = p
            if p.get("ok"):
                pauses["sglang"] = p["publish_s_median"]
        finally:
            server.stop()
    _save(out, details)


def _embedded_part(model_dir: Path, model: Any, vocab: int, out: Path, details: dict[str, Any]) -> None:
    """The embedded engine on the same GPU and model: the same checks, decode rates and pause."""
    from slime_async.launch.process import start_engine

    stages, rates, pauses = details["stages"], details["rates"], details["pauses"]
    engine = start_engine(model_dir, "--device", "cuda", "--dtype", "bfloat16", "--max-batch-size",
                          str(max(CONCURRENCY)), log_path=out / "embedded.log", timeout=300)
    try:
        checks = asyncio.run(run_checks(engine.url, model, vocab, dead_url(),
                                        out / "disk_embedded"))
        stages.update({f"embedded/{k}": v for k, v in checks.items()})
        rates["embedded"] = _guard_value(lambda: _rates(engine.url, vocab), stages, "embedded/decode")
        p = _guard(lambda: asyncio.run(publish_pause(engine.url, model, 100)))
        stages["embedded/publish_pause"] = p
        if p.get("ok"):
            pauses["embedded"] = p["publish_s_median"]
    finally:
        engine.stop()
    _save(out, details)


def _result(details: dict[str, Any]) -> Result:
    stages, rates, pauses = details["stages"], details["rates"], details["pauses"]
    rows: list[list[Any]] = []
    for c in map(str, CONCURRENCY):
        s, e = rates.get("sglang", {}).get(c), rates.get("embedded", {}).get(c)
        if s and e:
            rows.append(["decode tok/s", f"concurrency {c}", s, e, e / s])
    if "sglang" in pauses and "embedded" in pauses:
        rows.append(["weight push s (pause, update, continue)", "0.5B bf16, tensor handles",
                     pauses["sglang"], pauses["embedded"], pauses["embedded"] / pauses["sglang"]])
    for name, stage in stages.items():
        rows.append(["check", name, "ok" if stage.get("ok") else "FAILED", "", ""])
    passed = sum(bool(s.get("ok")) for s in stages.values())
    ratio = (rates["embedded"]["32"] / rates["sglang"]["32"]) if "32" in rates.get("embedded", {}) \
        and "32" in rates.get("sglang", {}) else float("nan")
    headline = (f"real SGLang {details['sglang']} on {details['device']}: {passed}/{len(stages)} checks passed; "
                f"embedded / SGLang decode at 32 concurrent: {ratio:.2f}x (peer anchor, P6)")
    return Result(columns=["measure", "case", "SGLang", "embedded", "embedded / SGLang"], rows=rows,
                  headline=headline, details=details)


def _save(out: Path, details: dict[str, Any]) -> None:
    """What is known so far, in case the run is cut short (a device call has a time limit)."""
    (out / "partial.json").write_text(json.dumps(details, indent=1, default=str))


def _guard(step) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    try:
        return step()
    except Exception as exc:  # one failed stage must not hide the others' figures
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}


def _guard_value(step, stages: dict[str, Any], name: str) -> Any:  # type: ignore[no-untyped-def]
    try:
        value = step()
        stages[name] = {"ok": True, "tok_s": value}
        return value
    except Exception as exc:
        stages[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
        return {}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
