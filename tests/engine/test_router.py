"""The real sglang-router (Rust, from PyPI) in front of two embedded engines: routing and a dead worker."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy

from slime_async.config import load_config
from slime_async.launch.local import HOST, PORT, SECOND_PORT, fill
from slime_async.launch.process import ChildProcess, start_engine, start_process
from slime_async.launch.sglang_command import router_argv

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    async with session.get(url + "/workers") as resp:
        return {w["url"]: w["is_healthy"] for w in (await resp.json())["workers"]}


def start_router(worker_urls: list[str], log_dir: Path) -> tuple[ChildProcess, str]:
    """The router as the launcher starts it (`router_argv`: its metrics on a free port of their own), on a
    free port, its output logged. A port found free can be taken by another process before the router
    binds it (it then exits: "Address already in use"): try other ports, a few times."""
    cfg = load_config(None, ["engine.router.enabled=true", "engine.router.policy=round_robin",
                             "engine.router.args={health_check_interval_secs: 1, health_failure_threshold: 1, "
                             "log_level: warn}"])
    for attempt in range(3):
        port = free_port()
        argv = [fill(a, "127.0.0.1", port, "") for a in router_argv(cfg, worker_urls, HOST, PORT, SECOND_PORT)]
        router = start_process("router", argv, None, log_path=log_dir / f"router-{attempt}.log")
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # bounded (120 s): it binds at once, before its workers are healthy
            if not router.alive():
                break
            try:  # the router's own answer, not whoever else may have taken the port
                with urllib.request.urlopen(url + "/workers", timeout=5) as resp:
                    if "workers" in json.loads(resp.read()):
                        return router, url
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        else:
            router.stop()
            pytest.fail(f"the router did not listen on port {port} in 120 s:\n{router.tail(50)}")
        if "Address already in use" not in router.tail(50):
            pytest.fail(f"the router exited with code {router.returncode}:\n{router.tail(50)}")
    pytest.fail(f"the router found no free port in 3 tries:\n{router.tail(50)}")


async def wait_until(predicate, timeout: float = 60.0, alive: ChildProcess | None = None) -> None:
    """Poll an async condition (bounded); fail with the last state if it never holds, or at once with
    its output if `alive` (the process that must answer) has exited."""
    last = None
    for _ in range(int(timeout / 0.2)):
        if alive is not None and not alive.alive():
            pytest.fail(f"{alive.name} exited with code {alive.returncode}:\n{alive.tail(50)}")
        try:
            ok, last = await predicate()
        except aiohttp.ClientError as exc:
            ok, last = False, exc
        if ok:
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"condition never held; last state: {last}")


async def test_router_routes_to_both_engines_and_detects_a_dead_one(
    varied_model_dir: Path, reference: torch.nn.Module, tmp_path: Path
) -> None:
    a, b = start_engine(varied_model_dir), start_engine(varied_model_dir)
    router: ChildProcess | None = None
    try:
        router, url = start_router([a.url, b.url], tmp_path)
        async with aiohttp.ClientSession() as session:
            async def both_healthy():
                state = await workers(session, url)
                return state == {a.url: True, b.url: True}, state

            # two engine processes and the router start (the router waits for its workers): on 2 cores shared
            # with another test worker this took over a minute once
            await wait_until(both_healthy, timeout=180.0, alive=router)
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

            await wait_until(a_unhealthy, alive=router)
            for body in bodies[:4]:
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["output_ids"] == hf_greedy(reference, body["input_ids"], 10)
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()


def test_two_routers_run_side_by_side(tmp_path: Path) -> None:
    """Two runs on one machine, each with its router: sglang-router's metrics listener defaults to
    0.0.0.0:29000, where the second router died at start (CI: two test workers, each with a router);
    the launcher gives each its own port on the run's host."""
    first, first_url = start_router(["http://127.0.0.1:1"], tmp_path / "first")
    try:
        second, second_url = start_router(["http://127.0.0.1:1"], tmp_path / "second")
        try:
            assert first.alive() and second.alive() and first_url != second_url
            metrics = [a for r in (first, second) for a in r.argv[r.argv.index("--prometheus-port") + 1:][:1]]
            assert len(set(metrics)) == 2 and "29000" not in metrics
        finally:
            second.stop()
    finally:
        first.stop()
