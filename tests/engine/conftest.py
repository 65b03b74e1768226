"""An embedded engine in its own process, on the tiny model, reached over real HTTP."""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from sglang_source import load_api, load_source

from slime_async.launch.process import start_engine


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


@pytest.fixture(scope="session")
def sglang_source() -> dict[str, ast.Module]:
    """SGLang 0.5.23's files the conformance tests read (`sglang_source.FILES`), parsed."""
    return load_source()


@pytest.fixture(scope="session")
def sglang_api(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return load_api(tmp_path_factory.mktemp("sglang"))
