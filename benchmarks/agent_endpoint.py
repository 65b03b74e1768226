"""The OpenAI-compatible endpoint's cost: CPU it adds per call over calling the engine directly, and
the memory of idle sessions.

Three processes: the minimal server (`benchmarks/minimal_server.py`: instant fixed replies, a
`calculate` call then the answer), this one (the rollout side: the SGLang client, the endpoint and its
sessions) and a load generator (`--drive`, raw aiohttp) that plays C agents at once, each a two-call
calculator conversation (call, tool result, answer) in its own session. The CPU of *this* process per
call is measured twice for the same calls: through the endpoint, then as direct `SGLangClient.generate`
calls of the same token ids at the same concurrency. Added CPU per call is the difference: request
decoding, the message check, rendering only the new messages, parsing the reply, the answer's JSON.

Idle sessions: RSS of this process before and after opening 10,000 sessions that make no call
(each an episode waiting on its agent), per 1,000 sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import Result

DESCRIPTION = "agent endpoint: added CPU per call vs the engine directly, at 1 and 100 sessions; 10,000 idle sessions"
PROMPT = "What is 12*34+5?"
_parked: tuple[asyncio.Queue, asyncio.Event] | None = None
"""The bench's hand-off with its parked agents (one event loop, one bench at a time)."""


async def parked(task: Any, base_url: str, api_key: str) -> float:
    """An agent that hands its session to the load generator and waits until the bench is done."""
    assert _parked is not None
    opened, finish = _parked
    opened.put_nowait((base_url, api_key))
    await finish.wait()
    return 1.0


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


async def _sessions(url: str, tokenizer: Any, sessions: int, drive: int | None) -> dict[str, Any]:
    """Open `sessions` parked sessions; with `drive=C`, run the load generator at concurrency C over
    them and then replay the same calls directly. Returns the figures."""
    global _parked
    from slime_async.agents import close_shared_server
    from slime_async.env import EnvFactory, Sampling
    from slime_async.rollout import SGLangClient
    from slime_async.rollout.scheduler import HttpPolicy
    from slime_async.types import Task

    opened: asyncio.Queue = asyncio.Queue()
    finish = asyncio.Event()
    _parked = (opened, finish)
    factory = EnvFactory.from_config("envs.openai_agent:AgentEnv",
                                     {"agent": "benchmarks.agent_endpoint:parked", "render_tools": False})
    out: dict[str, Any] = {"sessions": sessions}
    async with SGLangClient([url], max_connections=1024) as client:
        rss0 = _rss_mb()
        episodes = [asyncio.ensure_future(factory.episode(Task(id=str(i), prompt=PROMPT), HttpPolicy(client, str(i)),
                                                          tokenizer, sampling=Sampling(max_new_tokens=64)))
                    for i in range(sessions)]
        handles = [await opened.get() for _ in range(sessions)]
        out["rss_mb_per_1000"] = (_rss_mb() - rss0) / sessions * 1000
        if drive is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(handles, f)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "benchmarks.agent_endpoint", "--drive",
                                                        f.name, "--concurrency", str(drive))
            if await proc.wait() != 0:
                raise RuntimeError("the load generator failed")
            out["endpoint_cpu_s"], out["endpoint_wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
            Path(f.name).unlink()
        finish.set()
        trajectories = await asyncio.gather(*episodes)
        if drive is not None:
            calls = [_context(t, i) for t in trajectories for i in range(len(t.turns))]
            out["calls"] = len(calls)
            assert out["calls"] == 2 * sessions, f"{out['calls']} calls recorded for {sessions} two-call sessions"
            out["direct_cpu_s"], out["direct_wall_s"] = await _direct(client, calls, drive)
    await close_shared_server()
    _parked = None
    return out


def _context(traj: Any, turn: int) -> list[int]:
    ids: list[int] = []
    for t in traj.turns[:turn]:
        ids += t.prompt_ids.tolist() + t.completion_ids.tolist()
    return ids + traj.turns[turn].prompt_ids.tolist()


async def _direct(client: Any, calls: list[list[int]], concurrency: int) -> tuple[float, float]:
    queue = iter(calls)

    async def worker(i: int) -> None:
        for ids in queue:
            await client.generate(ids, {"max_new_tokens": 64}, episode=f"d{i}")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return time.process_time() - cpu0, time.perf_counter() - wall0


# ---- the load generator (its own process) --------------------------------------------------------


async def _drive(path: str, concurrency: int) -> None:
    import aiohttp

    handles = json.loads(Path(path).read_text())
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
    work = iter(handles)

    async def agent(http: aiohttp.ClientSession) -> None:
        for base_url, key in work:
            headers = {"Authorization": f"Bearer {key}"}
            messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
            body = {"model": "policy", "messages": messages, "tools": tools}
            async with http.post(base_url + "/chat/completions", json=body, headers=headers) as resp:
                reply = (await resp.json())["choices"][0]["message"]
            call = reply["tool_calls"][0]
            messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "413"}]
            async with http.post(base_url + "/chat/completions", json=body, headers=headers) as resp:
                final = (await resp.json())["choices"][0]["message"]["content"]
            assert final == "The answer is 413.", final

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(agent(http) for _ in range(concurrency)))


def run(quick: bool = False) -> Result:
    from transformers import AutoTokenizer

    from slime_async.launch.process import start_process
    from slime_async.train.tiny_model import cached_model_dir

    model_dir = cached_model_dir("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = start_process("minimal server", [sys.executable, "-m", "benchmarks.minimal_server", "--model",
                                              str(model_dir)], r"serving on (http://\S+)")
    cases = [(1, 100), (100, 500)] if quick else [(1, 500), (100, 2500)]
    idle = 2000 if quick else 10_000
    rows, details = [], {}
    try:
        for concurrency, sessions in cases:
            best: dict[str, Any] | None = None
            for _ in range(1 if quick else 3):  # each side's best of the rounds: a busy neighbour only adds
                r = asyncio.run(_sessions(server.url, tokenizer, sessions, concurrency))
                if best is None:
                    best = r
                else:
                    for side in ("endpoint", "direct"):
                        if r[f"{side}_cpu_s"] < best[f"{side}_cpu_s"]:
                            best[f"{side}_cpu_s"], best[f"{side}_wall_s"] = r[f"{side}_cpu_s"], r[f"{side}_wall_s"]
            assert best is not None
            calls = best["calls"]
            endpoint_us, direct_us = 1e6 * best["endpoint_cpu_s"] / calls, 1e6 * best["direct_cpu_s"] / calls
            details[concurrency] = best | {"endpoint_us_per_call": endpoint_us, "direct_us_per_call": direct_us}
            rows.append([concurrency, calls, direct_us, endpoint_us, endpoint_us - direct_us,
                         calls / best["direct_wall_s"], calls / best["endpoint_wall_s"]])
        memory = asyncio.run(_sessions(server.url, tokenizer, idle, None))
        details["idle"] = memory
    finally:
        server.stop()
    added = {c: details[c]["endpoint_us_per_call"] - details[c]["direct_us_per_call"] for c, _ in cases}
    headline = (f"endpoint's added CPU per call: {added[1]:,.0f} us at 1 session, {added[100]:,.0f} us at 100 "
                f"(direct: {details[1]['direct_us_per_call']:,.0f} / {details[100]['direct_us_per_call']:,.0f} us); "
                f"{idle:,} idle sessions: {memory['rss_mb_per_1000']:.1f} MB per 1,000")
    return Result(columns=["sessions at once", "calls", "direct CPU us/call", "endpoint CPU us/call",
                           "added CPU us/call", "direct calls/s", "endpoint calls/s"],
                  rows=rows, headline=headline, details={str(k): v for k, v in details.items()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_endpoint")
    parser.add_argument("--drive", required=True, help="JSON file of [base_url, api_key] sessions to play")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(_drive(args.drive, args.concurrency))
