"""Embedded engine: decode tokens/s against HF `generate`, and the weight-update pause against the copy bound.

Decode: the engine runs as its own process (`slime-async serve`) and is driven over HTTP by C
concurrent requests (16 random prompt tokens, 128 sampled tokens each, EOS ignored); HF
`generate` runs the same prompts as one batch of C in this process while the engine idles.

Weight update: the time the engine's loop is held to copy a full set of weights in place
(`Engine.load_weights`, run between decode steps), against the copy bound: the weights' bytes
divided by the memcpy bandwidth measured here on a 256 MiB tensor.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import torch

from benchmarks import Result

DESCRIPTION = "embedded engine: decode tokens/s vs HF generate; weight-update pause vs the memcpy bound"
NEW_TOKENS = 128
PROMPT_TOKENS = 16


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, vocab, (n, PROMPT_TOKENS), generator=g).tolist()


async def _engine_rate(url: str, prompts: list[list[int]]) -> float:
    body = {"sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(ids: list[int]) -> int:
            async with session.post(url + "/generate", json={**body, "input_ids": ids}) as resp:
                return (await resp.json())["meta_info"]["completion_tokens"]

        await one(prompts[0])  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens / (time.perf_counter() - start)


def _hf_rate(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    model.generate(ids[:1], **{**kwargs, "attention_mask": torch.ones_like(ids[:1])})  # warm-up
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)


def _memcpy_gbps() -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() / min(times) / 1e9


def _update_pause(engine, repeats: int) -> tuple[float, int]:
    """Median seconds the engine loop spends in load_weights for the model's full state, and bytes."""
    tensors = {k: v.clone() for k, v in engine.model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    loop = asyncio.new_event_loop()
    times = []
    for _ in range(repeats):
        def timed() -> float:
            start = time.perf_counter()
            engine.load_weights(tensors, None)
            return time.perf_counter() - start
        times.append(loop.run_until_complete(engine.call(timed, loop)))
    loop.close()
    return statistics.median(times), nbytes


def run(quick: bool = False) -> Result:
    from transformers import AutoModelForCausalLM

    from slime_async.engine.launch import load_engine
    from slime_async.engine.process import start_engine
    from slime_async.train.tiny_model import cached_model_dir

    tiny = cached_model_dir("tiny")
    rows: list[list] = []
    details: dict = {"decode": {}, "update": {}}
    concurrencies = (1, 8, 32) if quick else (1, 8, 32, 64)
    server = start_engine(tiny, "--max-batch-size", "64")
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    try:
        for c in concurrencies:
            prompts = _prompts(c, model.config.vocab_size)
            engine = asyncio.run(_engine_rate(server.url, prompts))
            hf = _hf_rate(model, prompts)
            details["decode"][c] = {"engine_tok_s": engine, "hf_tok_s": hf}
            rows.append(["decode tok/s", f"concurrency {c}", engine, hf, engine / hf])
    finally:
        server.stop()
    gbps = _memcpy_gbps()
    for preset in ("tiny",) if quick else ("tiny", "100m"):
        engine = load_engine(cached_model_dir(preset), device="cpu", max_batch_size=4)
        pause, nbytes = _update_pause(engine, 3 if quick else 7)
        engine.shutdown()
        bound = nbytes / (gbps * 1e9)
        details["update"][preset] = {"pause_s": pause, "bytes": nbytes, "bound_s": bound}
        rows.append(["update pause ms", f"{preset} ({nbytes / 2**20:.0f} MiB)", pause * 1e3, bound * 1e3,
                     pause / bound])
    details["memcpy_GBps"] = gbps
    ratio32 = details["decode"][32]["engine_tok_s"] / details["decode"][32]["hf_tok_s"]
    worst = max(u["pause_s"] / u["bound_s"] for u in details["update"].values())
    headline = (f"decode tok/s vs HF generate at concurrency 32: {ratio32:.2f}x (goal >= 3x); "
                f"weight-update pause vs copy bound: {worst:.2f}x (goal <= 1.5x)")
    return Result(columns=["measure", "case", "engine", "reference", "ratio"], rows=rows, headline=headline,
                  details=details)
