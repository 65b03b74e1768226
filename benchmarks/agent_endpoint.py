"""The agent endpoint's cost: CPU it adds per call over calling the engine directly, in each of its APIs
(chat completions, Anthropic messages, OpenAI responses), and the memory of idle sessions.

Three processes: the minimal server (`benchmarks/minimal_server.py`: instant fixed replies, a
`calculate` call then the answer), this one (the rollout side: the SGLang client, the endpoint and its
sessions) and a load generator (`--drive`, raw aiohttp) that plays C agents at once, each a two-call
calculator conversation (call, tool result, answer) in its own session, in one API (`--api`). The CPU of
*this* process per call is measured twice for the same calls: through the endpoint, then as direct
`SGLangClient.generate` calls of the same token ids at the same concurrency. Added CPU per call is the
difference: request decoding, the message check, rendering only the new messages, parsing the reply,
the answer's JSON.

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

DESCRIPTION = ("agent endpoint: added CPU per call vs the engine directly, per API (chat completions, messages, "
               "responses), at 1 and 100 sessions; 10,000 idle sessions")
APIS = ("chat", "messages", "responses")
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


async def _sessions(url: str, tokenizer: Any, sessions: int, drive: int | None, api: str = "chat") -> dict[str, Any]:
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
                                                        f.name, "--concurrency", str(drive), "--api", api)
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


async def _drive(path: str, concurrency: int, api: str) -> None:
    import aiohttp

    handles = json.loads(Path(path).read_text())
    schema = {"type": "object"}
    work = iter(handles)

    async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if api != "messages" else {"x-api-key": key}
        async with http.post(url, json=body, headers=headers) as resp:
            return await resp.json()

    async def conversation(http: aiohttp.ClientSession, base_url: str, key: str) -> str:
        """The two calls in `api`'s own shapes, as its SDK would send them; the final text."""
        if api == "chat":
            messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
            body = {"model": "policy", "messages": messages,
                    "tools": [{"type": "function", "function": {"name": "calculate", "parameters": schema}}]}
            reply = (await post(http, base_url + "/chat/completions", body, key))["choices"][0]["message"]
            messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "413"}]
            return (await post(http, base_url + "/chat/completions", body, key))["choices"][0]["message"]["content"]
        if api == "messages":
            messages = [{"role": "user", "content": PROMPT}]
            body = {"model": "policy", "max_tokens": 64, "messages": messages,
                    "tools": [{"name": "calculate", "input_schema": schema}]}
            reply = await post(http, base_url + "/messages", body, key)
            messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": reply["content"][0]["id"], "content": "413"}]}]
            return (await post(http, base_url + "/messages", body, key))["content"][0]["text"]
        items: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
        body = {"model": "policy", "input": items, "tools": [{"type": "function", "name": "calculate",
                                                              "parameters": schema}]}
        output = (await post(http, base_url + "/responses", body, key))["output"]
        items += [*output, {"type": "function_call_output", "call_id": output[0]["call_id"], "output": "413"}]
        return (await post(http, base_url + "/responses", body, key))["output"][0]["content"][0]["text"]

    async def agent(http: aiohttp.ClientSession) -> None:
        for base_url, key in work:
            final = await conversation(http, base_url, key)
            assert final == "The answer is 413.", final

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(agent(http) for _ in range(concurrency)))


def run(quick: bool = False) -> Result:
    from transformers import AutoTokenizer

    from slime_async.launch.process import start_process
    from slime_async.models.tiny_model import cached_model_dir

    model_dir = cached_model_dir("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = start_process("minimal server", [sys.executable, "-m", "benchmarks.minimal_server", "--model",
                                              str(model_dir)], r"serving on (http://\S+)")
    cases = [(1, 100), (100, 500)] if quick else [(1, 500), (100, 2500)]
    idle = 2000 if quick else 10_000
    rows, details = [], {}
    try:
        for api in APIS:
            for concurrency, sessions in cases:
                best: dict[str, Any] | None = None
                for _ in range(1 if quick else 3):  # each side's best of the rounds: a busy neighbour only adds
                    r = asyncio.run(_sessions(server.url, tokenizer, sessions, concurrency, api))
                    if best is None:
                        best = r
                    else:
                        for side in ("endpoint", "direct"):
                            if r[f"{side}_cpu_s"] < best[f"{side}_cpu_s"]:
                                best[f"{side}_cpu_s"], best[f"{side}_wall_s"] = r[f"{side}_cpu_s"], r[f"{side}_wall_s"]
                assert best is not None
                calls = best["calls"]
                endpoint_us, direct_us = 1e6 * best["endpoint_cpu_s"] / calls, 1e6 * best["direct_cpu_s"] / calls
                details[f"{api}/{concurrency}"] = best | {"endpoint_us_per_call": endpoint_us,
                                                          "direct_us_per_call": direct_us}
                rows.append([api, concurrency, calls, direct_us, endpoint_us, endpoint_us - direct_us,
                             calls / best["direct_wall_s"], calls / best["endpoint_wall_s"]])
        memory = asyncio.run(_sessions(server.url, tokenizer, idle, None))
        details["idle"] = memory
    finally:
        server.stop()

    def added(api: str, concurrency: int) -> float:
        d = details[f"{api}/{concurrency}"]
        return d["endpoint_us_per_call"] - d["direct_us_per_call"]

    per_api = "; ".join(f"{api} {added(api, 1):,.0f} / {added(api, 100):,.0f}" for api in APIS)
    headline = (f"endpoint's added CPU per call (us, at 1 / 100 sessions): {per_api} (direct: "
                f"{details['chat/1']['direct_us_per_call']:,.0f} / {details['chat/100']['direct_us_per_call']:,.0f} "
                f"us); {idle:,} idle sessions: {memory['rss_mb_per_1000']:.1f} MB per 1,000")
    return Result(columns=["API", "sessions at once", "calls", "direct CPU us/call", "endpoint CPU us/call",
                           "added CPU us/call", "direct calls/s", "endpoint calls/s"],
                  rows=rows, headline=headline, details=details)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_endpoint")
    parser.add_argument("--drive", required=True, help="JSON file of [base_url, api_key] sessions to play")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--api", choices=APIS, default="chat")
    args = parser.parse_args()
    asyncio.run(_drive(args.drive, args.concurrency, args.api))
