"""Two Megatron trainer ranks as real processes (gloo on CPU) sharing one loop.

A real buffer server process, a real embedded engine process and `python -m slime_async.train.worker
... --rank R --world-size 2 --dist-init tcp://...`: rank 0 alone reads the buffer and publishes;
rank 1 is given a recording HTTP "engine" of its own, which must never be called. Every wait is
bounded and waits on a condition (a line, an exit), never on a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from slime_async.buffer import BufferClient, ServerSettings
from slime_async.config.schema import BufferConfig
from slime_async.launch.process import ChildProcess, start_engine, start_process

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
FEED = Path(__file__).with_name("ranks_feed.py")
GROUP, BATCH = 4, 8
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[ChildProcess]:
    server = start_engine(tiny_model_dir, "--max-batch-size", "2", "--context-length", "256")
    yield server
    server.stop()


class Trap:
    """An HTTP server that records every request: the follower's only engine URL."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                requests.append(f"{self.command} {self.path}")
                self.send_response(500)
                self.end_headers()

            do_GET = do_POST = _record

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, model: Path, tp: int, **over: Any) -> Path:
    cfg: dict[str, Any] = {
        "run": {"name": "ranks", "dir": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(model), "device": "cpu", "dtype": "float32"},
        "rollout": {"batch_size": BATCH, "group_size": GROUP, "max_staleness": 100},
        "train": {"backend": "megatron", "loss": "grpo", "lr": 1e-3, "steps": 3, "micro_batch_size": 4,
                  "max_seq_len": 64, "checkpoint_every": 0, "batch_timeout_s": 1.0, "control_timeout_s": 60.0,
                  "world_size": 2, "megatron": {"tensor_parallel": tp}},
        "sync": {"mode": "tensor", "retries": 0},
        "log": {"tensorboard": False, "sample_every": 0},
    }
    for key, value in over.items():
        section, name = key.split("__")
        cfg[section][name] = value
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[str]:
    settings = ServerSettings(buffer=BufferConfig(wal_dir=None), group_size=GROUP, max_staleness=100)
    proc = start_process("buffer", [sys.executable, "-m", "slime_async.buffer", msgspec.json.encode(settings).decode()],
                         r"^READY (\S+)", timeout=60, env=ENV)
    yield proc.ready
    proc.stop()


def feed(endpoint: str, count: int, seed: int = 0) -> None:
    done = subprocess.run([sys.executable, str(FEED), endpoint, str(count), str(GROUP), str(seed)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-2000:]


STARTED: list[ChildProcess] = []


@pytest.fixture(autouse=True)
def no_rank_left() -> Iterator[None]:
    """Whatever a test started ends with it, also when it fails."""
    yield
    while STARTED:
        STARTED.pop().stop(timeout=5)


def start_ranks(config: Path, endpoint: str, engine: str, trap: Trap) -> list[ChildProcess]:
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [start_process(f"rank{rank}", [sys.executable, "-m", "slime_async.train.worker", str(config),
                                          "--buffer", endpoint, "--engine", engine if rank == 0 else trap.url,
                                          "--rank", str(rank), "--world-size", "2", "--dist-init", init],
                           None, env=ENV) for rank in range(2)]
    STARTED.extend(ranks)
    return ranks


def wait_until(ranks: list[ChildProcess], predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            for r in ranks:
                r.proc.kill()
            pytest.fail(f"timed out after {timeout} s waiting for {what}:\n" + logs(ranks))
        time.sleep(0.1)  # polling a condition, bounded by the deadline


def wait_exit(ranks: list[ChildProcess], timeout: float) -> list[int]:
    wait_until(ranks, lambda: all(r.proc.poll() is not None for r in ranks), timeout, "both ranks to exit")
    return [r.proc.returncode for r in ranks]


def logs(ranks: list[ChildProcess]) -> str:
    return "\n".join(f"--- {r.name} ---\n{r.tail(40)}" for r in ranks)


def has(rank: ChildProcess, text: str) -> bool:
    return any(text in line for line in list(rank.log))


def metrics(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "runs" / "ranks" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def balanced(endpoint: str) -> dict[str, int]:
    with BufferClient(endpoint) as client:
        m = client.metrics()
    assert m["received"] == m["trained"] + m["buffered"] + m["dropped_total"], m
    return m


def engine_version(url: str) -> int:
    with urllib.request.urlopen(url + "/get_model_info", timeout=10) as r:
        return int(json.loads(r.read())["weight_version"])


def test_tp2_ranks_train_publish_from_rank_0_and_resume_after_rank_0_dies(
        tmp_path: Path, tiny_model_dir: Path, engine: ChildProcess, buffer: str, trap: Trap) -> None:
    feed(buffer, 7 * BATCH)
    config = write_config(tmp_path, tiny_model_dir, 2, train__steps=5, train__checkpoint_every=2)
    ranks = start_ranks(config, buffer, engine.url, trap)
    wait_until(ranks, lambda: len(metrics(tmp_path)) >= 3, 150, "three steps")
    ranks[0].proc.send_signal(signal.SIGKILL)
    # the follower notices that rank 0 is gone (its sockets closed) and exits by itself, with an error
    wait_until(ranks, lambda: ranks[1].proc.poll() is not None, 60, "rank 1 to notice that rank 0 died")
    assert ranks[1].proc.returncode != 0
    saved = [int(p.name.split("_")[1]) for p in (tmp_path / "runs" / "ranks" / "checkpoints").glob("step_*")]
    assert max(saved) in (2, 4)  # 4 only when rank 0 got that far before the kill landed
    assert balanced(buffer)["trained"] >= 2 * BATCH

    again = start_ranks(config, buffer, engine.url, trap)
    assert wait_exit(again, 150) == [0, 0], logs(again)
    resumed = max(saved)
    assert has(again[0], f"READY version={resumed} resumed=True"), logs(again)
    assert has(again[1], f"READY version={resumed} rank=1") and has(again[1], "DONE version=5 rank=1"), logs(again)
    versions = [m["version"] for m in metrics(tmp_path)]
    assert versions[-(5 - resumed):] == list(range(resumed + 1, 6))  # the version goes on from the checkpoint
    assert all(m["trajectories"] == BATCH for m in metrics(tmp_path))
    assert engine_version(engine.url) == 5  # rank 0 published every version
    assert trap.requests == []  # rank 1 never spoke to an engine
    m = balanced(buffer)
    assert m["received"] == 7 * BATCH and m["trained"] >= 5 * BATCH
    ckpt = tmp_path / "runs" / "ranks" / "checkpoints" / "step_00000005"
    assert (ckpt / "state.json").is_file() and (ckpt / "model" / "model.safetensors").is_file()
    # each rank's optimizer state and RNG went into the one checkpoint directory
    assert len(list((ckpt / "model").glob("optimizer_*.pt"))) == 2 and (ckpt / "rng_rank1.pt").is_file()


def test_dp2_ranks_train_and_sigterm_to_the_follower_ends_both_after_the_same_step(
        tmp_path: Path, tiny_model_dir: Path, engine: ChildProcess, buffer: str, trap: Trap) -> None:
    feed(buffer, 4 * BATCH)
    ranks = start_ranks(write_config(tmp_path, tiny_model_dir, 1, train__steps=1000), buffer, engine.url, trap)
    wait_until(ranks, lambda: len(metrics(tmp_path)) >= 2, 150, "two steps")
    ranks[1].proc.send_signal(signal.SIGTERM)
    assert wait_exit(ranks, 60) == [0, 0], logs(ranks)
    done = [line for line in ranks[0].log if line.startswith("DONE")]
    version = int(done[0].split()[1].split("=")[1])
    assert 2 <= version <= 4 and has(ranks[1], f"DONE version={version} rank=1"), logs(ranks)
    assert [m["version"] for m in metrics(tmp_path)] == list(range(1, version + 1))
    assert engine_version(engine.url) == version and trap.requests == []
    m = balanced(buffer)
    assert m["trained"] == version * BATCH
    assert not (tmp_path / "runs" / "ranks" / "checkpoints").exists()  # stopped, not finished: no final save


def test_an_unreachable_engine_ends_both_ranks_with_rank_0s_error(
        tmp_path: Path, tiny_model_dir: Path, buffer: str, trap: Trap) -> None:
    feed(buffer, 2 * BATCH)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = write_config(tmp_path, tiny_model_dir, 2, sync__give_up_after=1, sync__timeout_s=5.0)
    started = time.monotonic()
    ranks = start_ranks(config, buffer, dead, trap)
    codes = wait_exit(ranks, 120)
    assert codes[0] != 0 and codes[1] == 1, logs(ranks)
    assert has(ranks[0], "sync.give_up_after=1") and has(ranks[0], dead), logs(ranks)
    assert has(ranks[1], "rank 0 stopped the run: PublishGaveUp: sync.give_up_after=1"), logs(ranks)
    assert time.monotonic() - started < 120
    assert trap.requests == []


def test_lora_ranks_publish_the_merged_layers_and_resume_from_the_adapters(
        tmp_path: Path, tiny_model_dir: Path, engine: ChildProcess, buffer: str, trap: Trap) -> None:
    """Tensor parallelism 2 with `train.lora`: the loop publishes the merged adapted layers from rank 0,
    checkpoints hold the adapters (peft's format, written whole by rank 0) and each rank's optimizer
    state, and a restart resumes from them."""
    feed(buffer, 3 * BATCH)
    lora = {"rank": 4, "alpha": 8.0}
    ranks = start_ranks(write_config(tmp_path, tiny_model_dir, 2, train__steps=2, train__lora=lora), buffer,
                        engine.url, trap)
    assert wait_exit(ranks, 150) == [0, 0], logs(ranks)
    assert engine_version(engine.url) == 2 and trap.requests == []
    ckpt = tmp_path / "runs" / "ranks" / "checkpoints" / "step_00000002" / "model"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "megatron.json", "optimizer_tp00_pp00_dp000.pt",
        "optimizer_tp01_pp00_dp000.pt"]
    again = start_ranks(write_config(tmp_path, tiny_model_dir, 2, train__steps=3, train__lora=lora), buffer,
                        engine.url, trap)
    assert wait_exit(again, 150) == [0, 0], logs(again)
    assert has(again[0], "READY version=2 resumed=True") and has(again[1], "DONE version=3 rank=1"), logs(again)
    assert engine_version(engine.url) == 3 and balanced(buffer)["trained"] == 3 * BATCH
