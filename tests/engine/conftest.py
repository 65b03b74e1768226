"""An embedded engine in its own process, on the tiny model, reached over real HTTP."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@dataclass
class ServerProcess:
    """A `slime-async serve` child process and the URL it printed once bound."""

    proc: subprocess.Popen
    url: str
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model_dir: Path, *args: str, timeout: float = 120.0) -> ServerProcess:
    """Start `slime-async serve` on port 0 and wait (bounded) for its `serving on URL` line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(model_dir), "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            match = re.search(r"serving on (http://\S+)", line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()
        found.set()  # the process ended: stop waiting

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout) or not url:
        proc.kill()
        raise RuntimeError("engine did not start:\n" + "".join(log[-30:]))
    return ServerProcess(proc, url[0], log)


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
    server = start_server(varied_model_dir, "--max-batch-size", "6", "--context-length", "1024")
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
