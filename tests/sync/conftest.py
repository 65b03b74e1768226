"""Engines in their own processes (`slime-async serve`), reached over real HTTP, for sync tests.

`start_server` and `perturbed` come from the engine's own test helpers, loaded by path (test
directories are not packages), so that there is one way to start an engine in the tests.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

_spec = importlib.util.spec_from_file_location(
    "engine_test_helpers", Path(__file__).parents[1] / "engine" / "conftest.py")
assert _spec is not None and _spec.loader is not None
engine_helpers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = engine_helpers  # dataclasses look their module up there
_spec.loader.exec_module(engine_helpers)
start_server = engine_helpers.start_server
perturbed = engine_helpers.perturbed

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


@pytest.fixture(scope="session")
def varied_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights whose greedy continuations vary from token to token.

    std 0.05 rather than the engine tests' 0.15: fp32 rounding differences between the engine's
    incremental decode and one full forward grow with the logits' size, and at 0.15 (logits far
    larger than a trained model's) they reach 3e-5, past the 1e-5 that the agreement test asks for;
    at 0.05 they stay near 2e-6 (the unperturbed model: 1e-6) and greedy output still varies."""
    out = tmp_path_factory.mktemp("varied")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=0, std=0.05).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(varied_dir: Path) -> Iterator[Any]:
    server = start_server(varied_dir, "--max-batch-size", "4", "--context-length", "512")
    yield server
    server.stop()
