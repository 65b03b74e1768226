"""What our parts expect of an SGLang-API server, checked against a live one (issue 38).

Each check drives the server only through our own parts (the rollout client, the weight publisher)
and compares what they recorded with what the server itself says: the raw `/generate` replies our
client parsed, the server's own prompt scoring (`logprob_start_len` / `input_token_logprobs`) of the
tokens we recorded, `/get_model_info`'s `weight_version` after each push, and the logprobs of the
trainer's weights computed here. `benchmarks/sglang_gpu.py` runs them against real SGLang on a GPU;
`tests/engine/test_sglang_checks.py` runs the same code against the embedded engine on CPU, so
a check that is wrong fails here first, not on the lent GPU.

A check returns a dict of figures and `ok`; it raises only if the server cannot be reached at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch

from slime_async.config.schema import SyncConfig
from slime_async.launch.local import free_port
from slime_async.rollout.client import SGLangClient
from slime_async.sync.publisher import WeightPublisher

PROMPT_LEN = 16


class RecordingClient(SGLangClient):
    """Our client, keeping each raw `/generate` reply it parsed (to compare with what it recorded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw: list[bytes] = []

    def _parse(self, raw: bytes):  # type: ignore[no-untyped-def]
        self.raw.append(raw)
        return super()._parse(raw)


def dead_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago): the failover check's dead server."""
    return f"http://127.0.0.1:{free_port('127.0.0.1')}"


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, PROMPT_LEN), generator=g).tolist()


async def post(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + path, json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


async def score(session: aiohttp.ClientSession, url: str, ids: list[int], start: int) -> list[float]:
    """The server's own logprobs of `ids[start:]`, each given the tokens before it (prompt scoring)."""
    status, out = await post(session, url, "/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": start - 1,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}})
    if status != 200:
        raise RuntimeError(f"prompt scoring refused: HTTP {status}: {str(out)[:300]}")
    entries = out["meta_info"]["input_token_logprobs"]
    if [e[1] for e in entries[1:]] != ids[start:]:
        raise RuntimeError("prompt scoring returned other token ids than it was given")
    return [float(e[0]) for e in entries[1:]]


async def server_version(session: aiohttp.ClientSession, url: str) -> str | None:
    async with session.get(url + "/get_model_info") as resp:
        return (await resp.json()).get("weight_version")


async def check_generate(url: str, vocab: int, n: int = 8, new_tokens: int = 32) -> dict[str, Any]:
    """Our client's recorded ids, logprobs and versions = the server's raw reply; the recorded
    logprobs = the server's own scoring of the same tokens (decode vs prefill: bf16 rounding)."""
    async with RecordingClient([url]) as client, aiohttp.ClientSession() as session:
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        # one at a time: the raw replies then come in the order of the calls
        gens = [await client.generate(p, params) for p in prompts(n, vocab)]
        mismatched = 0
        for gen, raw in zip(gens, client.raw, strict=True):
            reply = json.loads(raw)
            meta = reply["meta_info"]
            same = (gen.output_ids.tolist() == reply["output_ids"]
                    and np.allclose(gen.logprobs, [e[0] for e in meta["output_token_logprobs"]], atol=1e-6)
                    and [e[1] for e in meta["output_token_logprobs"]] == reply["output_ids"])
            mismatched += not same
        gaps = []
        for p, gen in zip(prompts(n, vocab), gens, strict=True):
            ids = p + gen.output_ids.tolist()
            scored = await score(session, url, ids, len(p))
            gaps.append(np.abs(np.asarray(scored) - gen.logprobs.astype(np.float64)))
        gap = np.concatenate(gaps)
        versions = sorted({int(v) for g in gens for v in g.versions})
        return {"ok": mismatched == 0 and all(len(g.output_ids) == new_tokens for g in gens),
                "requests": n, "tokens": int(sum(len(g.output_ids) for g in gens)),
                "recorded_vs_raw_mismatches": mismatched, "versions": versions,
                "decode_vs_scoring_max": float(gap.max()), "decode_vs_scoring_mean": float(gap.mean()),
                "finish_reasons": sorted({g.finish_reason for g in gens})}


async def check_abort(url: str, vocab: int) -> dict[str, Any]:
    """A cancelled model call makes our client abort it on the server (`/abort_request` by rid): the
    server ends it early with finish_reason abort, and stays healthy."""
    client = SGLangClient([url])
    await client.start()
    async with aiohttp.ClientSession() as session:
        long = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
        rid = "abort-check"
        raw = asyncio.create_task(post(session, url, "/generate", {
            "input_ids": prompts(1, vocab)[0], "rid": rid, "sampling_params": long}))
        ours = asyncio.create_task(client.generate(prompts(1, vocab, seed=1)[0], long))
        await asyncio.sleep(1.0)  # both decoding; what follows does not depend on how far they got
        started = time.perf_counter()
        status, _ = await post(session, url, "/abort_request", {"rid": rid})
        _, reply = await raw
        abort_s = time.perf_counter() - started
        ours.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ours
        await client.close()  # waits for the abort it sent
        after = await client_generate_once(url, vocab)
        finish = reply["meta_info"]["finish_reason"] if isinstance(reply, dict) else None
        produced = reply["meta_info"]["completion_tokens"] if isinstance(reply, dict) else None
        return {"ok": status == 200 and isinstance(finish, dict) and finish.get("type") == "abort"
                and produced is not None and produced < 4000 and client.stats.aborts_sent == 1 and after,
                "abort_status": status, "finish_reason": finish, "completion_tokens": produced,
                "abort_to_reply_s": abort_s, "client_aborts_sent": client.stats.aborts_sent}


async def client_generate_once(url: str, vocab: int) -> bool:
    async with SGLangClient([url]) as client:
        params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
        gen = await client.generate(prompts(1, vocab, seed=2)[0], params)
        return len(gen.output_ids) == 4


async def check_failover(url: str, dead: str, vocab: int, n: int = 8) -> dict[str, Any]:
    """With a dead server listed first, every episode is served by the live one."""
    async with SGLangClient([dead, url], retries=4, backoff=0.05) as client:
        params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
        gens = await asyncio.gather(*(client.generate(p, params, episode=f"e{i}")
                                      for i, p in enumerate(prompts(n, vocab))))
        return {"ok": all(g.server == url for g in gens) and all(len(g.output_ids) == 8 for g in gens),
                "served_by": sorted({g.server for g in gens}), "retries": client.stats.retries,
                "errors": dict(client.stats.errors)}


def trainer_logprobs(model: torch.nn.Module, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        x = torch.tensor([ids], device=next(model.parameters()).device)
        logits = model(x).logits[0].float()
        lp = torch.log_softmax(logits[start - 1:-1], dim=-1).gather(1, x[0, start:, None])[:, 0]
    return lp.tolist()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Move every weight by a small random amount (a trainer's step, for the checks): on a random
    100M model 0.05 of each tensor's std moves logprobs ~0.1 on average, 10x bf16's rounding (~0.01)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * scale * p.float().std())


async def check_publish(url: str, model: torch.nn.Module, vocab: int, version: int, mode: str,
                        disk_dir: Path | None, tensor_format: str = "auto", seed: int = 0,
                        partial_mode: str = "abort") -> dict[str, Any]:
    """One push of `model`'s perturbed weights by our publisher (pause, update, continue; `abort`: the
    requests in flight end and are resumed, and the cache is flushed before the engine resumes): the
    server reports `version` and its logprobs equal the trainer's (before the push they differ), on the
    prompts it scored before the push (`abort`) or on fresh ones (`in_place`: SGLang's radix cache still
    holds the scored ones' KV of the old weights; their gap is `reused_prefix_gap_mean`)."""
    perturb(model, seed)
    seqs = [p + prompts(1, vocab, seed=100 + i)[0] for i, p in enumerate(prompts(4, vocab, seed=50))]
    fresh = [p + prompts(1, vocab, seed=200 + i)[0] for i, p in enumerate(prompts(4, vocab, seed=60))]
    cfg = SyncConfig(mode=mode, tensor_format=tensor_format)  # type: ignore[arg-type]
    async with aiohttp.ClientSession() as session, WeightPublisher(
            [url], cfg, disk_dir=disk_dir, partial_mode=partial_mode) as pub:  # type: ignore[arg-type]
        before = [await score(session, url, s, PROMPT_LEN) for s in seqs]
        # requests decoding through the push: paused in place, they finish after it
        params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
        async with SGLangClient([url]) as client:
            flying = [asyncio.create_task(client.generate(p, params)) for p in prompts(8, vocab, seed=7)]
            await asyncio.sleep(0.2)
            report = await pub.publish(lambda: model.named_parameters(), version)
            gens = await asyncio.gather(*flying)
        reused = [await score(session, url, s, PROMPT_LEN) for s in seqs]
        after = reused if partial_mode == "abort" else [await score(session, url, s, PROMPT_LEN) for s in fresh]
        reported = await server_version(session, url)
        status, flushed = await post(session, url, "/flush_cache", {})
    trainer = [trainer_logprobs(model, s, PROMPT_LEN) for s in seqs]
    trainer_after = trainer if partial_mode == "abort" else [trainer_logprobs(model, s, PROMPT_LEN) for s in fresh]
    gap_after = np.abs(np.asarray(after) - np.asarray(trainer_after))
    gap_before = np.abs(np.asarray(before) - np.asarray(trainer))
    gap_reused = np.abs(np.asarray(reused) - np.asarray(trainer))
    return {"ok": not report.failed and reported == str(version) and float(gap_after.max()) < 0.25
            and gap_after.mean() < gap_before.mean() / 4 and all(len(g.output_ids) == 64 for g in gens)
            and (partial_mode != "abort" or report.flushed == [url]),
            "mode": mode, "partial_mode": partial_mode, "flushed": report.flushed,
            "reused_prefix_gap_mean": float(gap_reused.mean()),
            "version_reported": reported, "publish_s": report.seconds, "bytes": report.bytes,
            "failed": report.failed, "trainer_vs_server_after_max": float(gap_after.max()),
            "trainer_vs_server_after_mean": float(gap_after.mean()),
            "trainer_vs_server_before_mean": float(gap_before.mean()),
            "in_flight_finished": sum(len(g.output_ids) == 64 for g in gens),
            "in_flight_versions": sorted({int(v) for g in gens for v in g.versions}),
            "flush_cache_status": status, "flush_cache_reply": str(flushed)[:200]}


async def publish_pause(url: str, model: torch.nn.Module, version: int, repeats: int = 5) -> dict[str, Any]:
    """Wall time of whole pushes (pause, update, continue) of the same weights, after one untimed."""
    cfg = SyncConfig(mode="tensor")
    times = []
    async with WeightPublisher([url], cfg) as pub:
        for i in range(repeats + 1):
            report = await pub.publish(lambda: model.named_parameters(), version + i)
            if report.failed:
                return {"ok": False, "failed": report.failed}
            if i:
                times.append(report.seconds)
    return {"ok": True, "publish_s_median": float(np.median(times)), "publish_s": times}


async def run_checks(url: str, model: torch.nn.Module, vocab: int, dead: str, disk_dir: Path,
                     tensor_format: str = "auto") -> dict[str, dict[str, Any]]:
    """Every check in order (the publishes move the server to versions 1 and 2)."""
    out: dict[str, dict[str, Any]] = {}
    steps = [("generate", lambda: check_generate(url, vocab)),
             ("abort", lambda: check_abort(url, vocab)),
             ("failover", lambda: check_failover(url, dead, vocab)),
             ("publish_tensor", lambda: check_publish(url, model, vocab, 1, "tensor", None, tensor_format, seed=1)),
             ("publish_disk", lambda: check_publish(url, model, vocab, 2, "disk", disk_dir, seed=2)),
             # in place: the weights reach the engine (fresh prompts), and what its cache keeps is measured
             ("publish_in_place", lambda: check_publish(url, model, vocab, 3, "tensor", None, tensor_format, seed=3,
                                                        partial_mode="in_place")),
             ("generate_after_push", lambda: check_generate(url, vocab, n=4))]
    for name, step in steps:
        try:
            out[name] = await step()
        except Exception as exc:  # one failed check must not hide the others' figures
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out
