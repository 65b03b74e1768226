"""Helpers for sync tests: engines in their own processes (`slime-async serve`), over real HTTP."""

from __future__ import annotations

from typing import Any

import aiohttp
from helpers import hf_greedy as _hf_greedy
from helpers import perturbed, post

from slime_async.launch.process import start_engine as start_server

__all__ = ["PROMPT", "engine_greedy", "get", "hf_greedy", "perturbed", "post", "start_server"]

PROMPT = [5, 6, 7, 8, 9]


def hf_greedy(model: Any, ids: list[int], n: int = 16) -> list[int]:
    return _hf_greedy(model, ids, n)


async def get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.json(content_type=None)


async def engine_greedy(url: str, ids: list[int], n: int = 16) -> tuple[list[int], str]:
    """Greedy output ids and the weight version that produced them."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    status, out = await post(url, "/generate", body)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]["weight_version"]
