"""Embedded engine: decode tokens/s against HF `generate`, and the weight-update pause against the copy bound.

Decode: the engine runs as its own process (`slime-async serve`) and is driven over HTTP by C
concurrent requests (16 random prompt tokens, 128 sampled tokens each, EOS ignored); HF
`generate` runs the same prompts as one batch of C in this process while the engine idles.
The two alternate for a few rounds and each keeps its best round: the 2-core machine is shared,
and a neighbour's burst would otherwise decide the ratio. The load average is recorded.

Weight update: the time the engine's loop is held to copy a full set of weights in place
(`Engine.load_weights`, run between decode steps), the median of several after 25 untimed ones,
against the copy bound: the weights' bytes divided by the memcpy bandwidth measured here on a
256 MiB tensor.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import aiohttp
import torch

from benchmarks import Result

DESCRIPTION = "embedded engine: decode tokens/s vs HF generate; weight-update pause vs the memcpy bound"
NEW_TOKENS = 128
PROMPT_TOKENS = 16
WARMUP_UPDATES = 25


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, vocab, (n, PROMPT_TOKENS), generator=g).tolist()


async def decode_rate(url: str, prompts: list[list[int]]) -> float:
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
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    model.generate(ids[:1], **{**kwargs, "attention_mask": torch.ones_like(ids[:1])})  # warm-up
    _sync(model.device.type)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    _sync(model.device.type)
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)


def _memcpy_gbps(device: str = "cpu") -> float:
    """Bytes copied per second by one large `copy_` on `device` (the bound of an in-place update)."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return src.numel() / min(times) / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _update_pause(engine, repeats: int) -> tuple[float, int]:
    """Median seconds the engine loop spends in load_weights for the model's full state, and bytes."""
    tensors = {k: v.clone() for k, v in engine.model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    loop = asyncio.new_event_loop()

    def timed() -> float:
        _sync(engine.slots.device.type)
        start = time.perf_counter()
        engine.load_weights(tensors, None)
        _sync(engine.slots.device.type)
        return time.perf_counter() - start

    # untimed first: a trainer updates every step, and the first updates after loading pay once for
    # what later ones reuse (on an H200 the first 25 of the 0.5B model took ~20% longer)
    for _ in range(WARMUP_UPDATES):
        loop.run_until_complete(engine.call(timed, loop))
    times = [loop.run_until_complete(engine.call(timed, loop)) for _ in range(repeats)]
    loop.close()
    return statistics.median(times), nbytes


def measure(preset: str, device: str, dtype: str, concurrencies: tuple[int, ...], update_presets: tuple[str, ...],
            repeats: int, rounds: int = 3) -> Result:
    """The decode table for `preset` on `device`, and the update pause for each of `update_presets`."""
    from transformers import AutoModelForCausalLM

    from slime_async.engine.launch import load_engine
    from slime_async.launch.process import start_engine
    from slime_async.models.tiny_model import cached_model_dir

    model_dir = cached_model_dir(preset)
    rows: list[list] = []
    details: dict = {"decode": {}, "update": {}, "preset": preset, "device": device, "dtype": dtype,
                     "rounds": rounds, "load_avg_start": os.getloadavg()}
    server = start_engine(model_dir, "--max-batch-size", str(max(concurrencies)), "--device", device,
                          "--dtype", dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    try:
        for c in concurrencies:
            prompts = _prompts(c, model.config.vocab_size)
            engine_runs, hf_runs = [], []
            for _ in range(rounds):
                engine_runs.append(asyncio.run(decode_rate(server.url, prompts)))
                hf_runs.append(_hf_rate(model, prompts))
            engine, hf = max(engine_runs), max(hf_runs)
            details["decode"][c] = {"engine_tok_s": engine, "hf_tok_s": hf, "engine_runs": engine_runs,
                                    "hf_runs": hf_runs}
            rows.append(["decode tok/s", f"{preset}, concurrency {c}", engine, hf, engine / hf])
    finally:
        server.stop()
    del model
    gbps = _memcpy_gbps(device)
    for name in update_presets:
        engine = load_engine(cached_model_dir(name), device=device, dtype=dtype, max_batch_size=4)
        pause, nbytes = _update_pause(engine, repeats)
        engine.shutdown()
        bound = nbytes / (gbps * 1e9)
        details["update"][name] = {"pause_s": pause, "bytes": nbytes, "bound_s": bound}
        rows.append(["update pause ms", f"{name} ({nbytes / 2**20:.0f} MiB)", pause * 1e3, bound * 1e3,
                     pause / bound])
    details["memcpy_GBps"] = gbps
    details["load_avg_end"] = os.getloadavg()
    c = 32 if 32 in details["decode"] else max(details["decode"])
    ratio = details["decode"][c]["engine_tok_s"] / details["decode"][c]["hf_tok_s"]
    worst = max(u["pause_s"] / u["bound_s"] for u in details["update"].values())
    headline = (f"decode tok/s vs HF generate at concurrency {c} ({preset}, {device}): {ratio:.2f}x (goal >= 3x); "
                f"weight-update pause vs copy bound: {worst:.2f}x (goal <= 1.5x)")
    return Result(columns=["measure", "case", "engine", "HF generate / bound", "ratio"], rows=rows,
                  headline=headline, details=details)


def run(quick: bool = False) -> Result:
    if quick:
        return measure("tiny", "cpu", "float32", (1, 8, 32), ("tiny", "100m"), repeats=5, rounds=2)
    return measure("tiny", "cpu", "float32", (1, 8, 32, 64), ("tiny", "100m"), repeats=9, rounds=3)
