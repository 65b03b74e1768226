"""Helpers shared by the tests: models with varied outputs, and talking to an engine over HTTP."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [40, 41], [100, 7, 300, 2, 11, 12, 13], [9] * 30]


def perturbed(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Replace every matrix with seeded noise: the random tiny model's greedy output repeats one
    token forever, which would make token-for-token comparisons weak."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    return model


def perturbed_copy(src: Path, out: Path, seed: int) -> Path:
    """`src`'s model directory (tokenizer, config) in `out`, with `perturbed` weights."""
    from transformers import AutoModelForCausalLM

    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    perturbed(AutoModelForCausalLM.from_pretrained(src), seed=seed).save_pretrained(out)
    return out


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each process's output once all have ended (the rest killed when one times out); asserts they
    all exited 0, showing the logs' tails when not."""
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return logs


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy_body(ids: list[int], n: int = 24, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True, **extra}


async def wait_for_tokens(url: str, running: int = 1, timeout: float = 30) -> None:
    """Wait (bounded) until the engine reports that many running requests with tokens out."""
    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout / 0.02)):
            async with session.get(url + "/get_server_info") as resp:
                state = (await resp.json())["internal_states"][0]
            if state["num_running_reqs"] >= running:
                return
            await asyncio.sleep(0.02)
    pytest.fail("the engine never started decoding")


def routing_agreement(model_dir: Any, batch: Any, layers: int, top_k: int) -> float:
    """Share of the batch's recorded positions where transformers' own routers (hooked, one forward over
    the whole rows) chose the same experts as the record (`Batch.routed_experts`; order within a layer's
    k ignored)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for m in hf.modules()
             if isinstance(m, Qwen3MoeTopKRouter)]
    with torch.no_grad():
        hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for h in hooks:
        h.remove()
    n, t = batch.input_ids.shape
    own = torch.cat([s.reshape(n, t, top_k).sort(-1).values for s in seen], dim=-1)
    record = batch.routed_experts.long().reshape(n, t, layers, top_k).sort(-1).values.reshape(n, t, -1)
    fed = batch.routed_experts[..., 0] >= 0
    return float((own == record).all(-1)[fed].float().mean())
