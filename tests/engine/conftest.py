"""An embedded engine in its own process, on the tiny model, reached over real HTTP."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.engine.process import start_engine


def perturbed(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Replace every matrix with seeded noise: the random tiny model's greedy output repeats one
    token forever, which would make token-for-token comparisons weak."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    return model


@pytest.fixture(scope="session")
def varied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights whose greedy continuations vary from token to token."""
    out = tmp_path_factory.mktemp("varied")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=0).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def reference(varied_model_dir: Path) -> torch.nn.Module:
    """The same weights in this process, as HF's own model: what the engine must agree with."""
    return AutoModelForCausalLM.from_pretrained(varied_model_dir).eval()


@pytest.fixture(scope="module")
def engine_url(varied_model_dir: Path) -> Iterator[str]:
    server = start_engine(varied_model_dir, "--max-batch-size", "6", "--context-length", "1024")
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path):
    from slime_async.engine.launch import load_engine

    engine = load_engine(tiny_model_dir, device="cpu", max_batch_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture
async def aiohttp_engine(tiny_engine) -> AsyncIterator[str]:
    """An EngineServer configured for a public address with a token, served on loopback for the test."""
    from aiohttp.test_utils import TestServer

    from slime_async.engine.server import EngineServer

    server = TestServer(EngineServer(tiny_engine, "m", host="0.0.0.0", admin_token="s3cret").app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()
