"""The remote reward client over real HTTP: the embedded engine as an LLM judge, and small aiohttp
servers that fail, hang or batch on purpose."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from helpers import post

from envs.chat import ChatArgs, ChatEnv
from slime_async.data import (
    RemoteReward,
    RemoteRewardArgs,
    RemoteRewardError,
    close_shared_remote_rewards,
)
from slime_async.data.remote_reward import DEFAULT_TEMPLATE
from slime_async.env import ScriptedPolicy, run_episode
from slime_async.launch.process import EngineProcess
from slime_async.types import Task


async def judge_reply(url: str, prompt: str, response: str, label: str) -> str:
    """What the judge answers, asked directly (greedy), to check the client's reading of it."""
    text = DEFAULT_TEMPLATE.format(prompt=prompt, response=response, label=label)
    status, out = await post(url, "/generate", {"text": text, "sampling_params": {"temperature": 0.0,
                                                                                   "max_new_tokens": 16}})
    assert status == 200
    return out["text"]


async def test_the_engine_as_judge_its_reply_becomes_a_score(engine: EngineProcess) -> None:
    reply = await judge_reply(engine.url, "What is 2+2?", "4", "4")
    word = reply.strip()[:3]
    assert word, "the judge said nothing"
    args = RemoteRewardArgs(url=engine.url, verdicts={word: 0.75, "\x00never": 0.1})
    async with RemoteReward(args) as judge:
        assert await judge.score("What is 2+2?", "4", "4") == 0.75
        assert judge.stats.scored == 1 and judge.stats.requests == 1
    # The same reply read with a pattern that finds nothing: an error naming the URL, counted.
    async with RemoteReward(RemoteRewardArgs(url=engine.url, score_pattern=r"SCORE=(\d+)")) as judge:
        with pytest.raises(RemoteRewardError, match=f"judge {engine.url}/generate: no score in its reply"):
            await judge.score("What is 2+2?", "4", "4")
        assert judge.stats.errors["unparseable"] == 1 and judge.stats.failed == 1


async def test_chat_env_scores_with_the_judge(engine: EngineProcess, tokenizer) -> None:
    reply = await judge_reply(engine.url, "Name a colour.", "blue", "red")
    args = ChatArgs(verifier="judge", judge=RemoteRewardArgs(url=engine.url, verdicts={reply.strip()[:3]: 1.0}))
    task = Task(id="t", prompt="Name a colour.", answer="red")
    t = await run_episode(ChatEnv(args), task, ScriptedPolicy(["blue"], tokenizer), tokenizer)
    bad = ChatArgs(verifier="judge", judge=RemoteRewardArgs(url=engine.url, score_pattern="NEVER(1)"))
    t_bad = await run_episode(ChatEnv(bad), task, ScriptedPolicy(["blue"], tokenizer), tokenizer)
    await close_shared_remote_rewards()
    assert t.rewards == {"correct": 1.0}
    assert t_bad.reward == 0.0 and t_bad.metrics["reward_errors"] == 1.0 and "no score" in t_bad.error


@pytest.fixture
async def server() -> AsyncIterator[Callable[[Any], Any]]:
    """Start an aiohttp app on a free loopback port; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Any) -> str:
        app = web.Application()
        app.router.add_post("/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for r in runners:
        await r.cleanup()


async def test_a_hanging_server_times_out_and_is_retried_then_fails(server) -> None:
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response(1.0)

    url = await server(hang)
    args = RemoteRewardArgs(url=url, mode="reward_model", timeout_s=0.2, retries=1, backoff_s=0.0)
    try:
        async with RemoteReward(args) as rm:
            with pytest.raises(RemoteRewardError, match=f"reward server {url} failed after 2 attempts: timed out"):
                await rm.score("p", "r", "l")
            assert rm.stats.errors["timeout"] == 2 and rm.stats.retries == 1 and rm.stats.failed == 1
    finally:
        never.set()  # let the abandoned handlers end, so that the server shuts down at once


async def test_an_unreachable_server_is_an_error_naming_the_url() -> None:
    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/rm"
    async with RemoteReward(RemoteRewardArgs(url=url, mode="reward_model", retries=2, backoff_s=0.0)) as rm:
        with pytest.raises(RemoteRewardError, match=f"reward server {url} failed after 3 attempts"):
            await rm.score("p", "r")
        assert rm.stats.errors["connection"] == 3


async def test_5xx_is_retried_and_slimes_reward_object_is_read(server) -> None:
    calls: list[dict[str, Any]] = []

    async def flaky(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if len(calls) == 1:
            return web.Response(status=503, text="busy")
        return web.json_response({"reward": 0.5})

    url = await server(flaky)
    async with RemoteReward(RemoteRewardArgs(url=url, mode="reward_model", backoff_s=0.0)) as rm:
        assert await rm.score("q", "a", "gold") == 0.5
        assert rm.stats.retries == 1 and rm.stats.errors["http_5xx"] == 1
    assert calls[-1] == {"prompt": "q", "response": "a", "label": "gold"}


async def test_a_4xx_is_not_retried(server) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=400, text="bad payload")

    url = await server(refuse)
    async with RemoteReward(RemoteRewardArgs(url=url, mode="reward_model")) as rm:
        with pytest.raises(RemoteRewardError, match="HTTP 400: bad payload"):
            await rm.score("q", "a")
        assert rm.stats.requests == 1 and rm.stats.retries == 0


async def test_concurrent_calls_are_gathered_into_batches(server) -> None:
    batches: list[int] = []

    async def rm_batch(request: web.Request) -> web.Response:
        items = await request.json()
        batches.append(len(items))
        return web.json_response([len(i["response"]) for i in items])

    url = await server(rm_batch)
    async with RemoteReward(RemoteRewardArgs(url=url, mode="reward_model", batch_size=4)) as rm:
        scores = await rm.score_many("p", ["a" * n for n in range(1, 9)])
    assert scores == [float(n) for n in range(1, 9)]
    assert batches == [4, 4]
