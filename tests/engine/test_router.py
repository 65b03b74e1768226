"""The real sglang-router (Rust, from PyPI) in front of two embedded engines: routing and a dead worker."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy

from slime_async.launch.process import start_engine

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    async with session.get(url + "/workers") as resp:
        return {w["url"]: w["is_healthy"] for w in (await resp.json())["workers"]}


async def wait_until(predicate, timeout: float = 60.0) -> None:
    """Poll an async condition (bounded); fail with the last state if it never holds."""
    last = None
    for _ in range(int(timeout / 0.2)):
        try:
            ok, last = await predicate()
        except aiohttp.ClientError as exc:
            ok, last = False, exc
        if ok:
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"condition never held; last state: {last}")


async def test_router_routes_to_both_engines_and_detects_a_dead_one(
    varied_model_dir: Path, reference: torch.nn.Module
) -> None:
    a, b = start_engine(varied_model_dir), start_engine(varied_model_dir)
    port = free_port()
    router = subprocess.Popen(
        [str(Path(sys.executable).with_name("sglang-router")), "launch", "--worker-urls", a.url, b.url,
         "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async def both_healthy():
                state = await workers(session, url)
                return state == {a.url: True, b.url: True}, state

            # two engine processes and the router start (the router waits for its workers): on 2 cores shared
            # with another test worker this took over a minute once
            await wait_until(both_healthy, timeout=180.0)
            bodies = [greedy_body(ids, n=10) for ids in PROMPTS * 2]
            outs = []
            for body in bodies:
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    outs.append(await resp.json())
            for body, out in zip(bodies, outs, strict=True):
                assert out["output_ids"] == hf_greedy(reference, body["input_ids"], 10)
            served = []
            for engine in (a, b):
                async with session.get(engine.url + "/get_server_info") as resp:
                    served.append((await resp.json())["internal_states"][0]["generated_tokens"])
            assert all(n > 0 for n in served), served  # round robin used both

            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait()

            async def a_unhealthy():
                state = await workers(session, url)
                return state.get(a.url) is False, state

            await wait_until(a_unhealthy)
            for body in bodies[:4]:
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["output_ids"] == hf_greedy(reference, body["input_ids"], 10)
    finally:
        router.terminate()
        router.wait(timeout=20)
        a.stop()
        b.stop()
