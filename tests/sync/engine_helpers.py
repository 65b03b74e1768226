"""Helpers for sync tests: engines in their own processes (`slime-async serve`), over real HTTP.

`start_server` and `perturbed` come from the engine's own test helpers, loaded by path (test
directories are not packages), so that there is one way to start an engine in the tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import aiohttp
import torch

_spec = importlib.util.spec_from_file_location(
    "engine_conftest", Path(__file__).parents[1] / "engine" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _engine  # dataclasses look their module up there
_spec.loader.exec_module(_engine)
start_server = _engine.start_server
perturbed = _engine.perturbed

PROMPT = [5, 6, 7, 8, 9]


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.json(content_type=None)


async def engine_greedy(url: str, ids: list[int], n: int = 16) -> tuple[list[int], str]:
    """Greedy output ids and the weight version that produced them."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    status, out = await post(url, "/generate", body)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]["weight_version"]


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int = 16) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()
