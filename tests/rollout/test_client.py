"""The SGLang client against real engine processes: routing, failover, faults, aborts, resumes."""

from __future__ import annotations

import asyncio
import copy
import socket

import pytest
import torch
from aiohttp import web
from helpers import PROMPTS, hf_greedy, perturbed, post, wait_for_tokens

from slime_async.launch.process import EngineProcess
from slime_async.rollout.client import ServerError, SGLangClient
from slime_async.weight_wire.codec import encode_named_tensors

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


async def server_state(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]


async def test_generate_is_exact_and_episodes_stick(engines: list[EngineProcess], reference) -> None:
    async with SGLangClient([e.url for e in engines]) as client:
        gen = await client.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 12}, episode="e1")
        assert gen.output_ids.tolist() == hf_greedy(reference, PROMPTS[1], 12)
        assert len(gen.logprobs) == len(gen.versions) == 12 and gen.finish_reason == "length"
        assert all(gen.versions == 0) and client.latest_version == 0
        again = await client.generate(PROMPTS[1] + gen.output_ids.tolist(), {**GREEDY, "max_new_tokens": 4},
                                      episode="e1")
        assert again.server == gen.server  # the episode's prefix stays on its server
        # many new episodes at once spread over the least loaded servers
        gens = await asyncio.gather(*(client.generate(p, {**GREEDY, "max_new_tokens": 30}, episode=f"n{i}")
                                      for i, p in enumerate(PROMPTS * 2)))
        assert {g.server for g in gens} == {e.url for e in engines}


async def test_dead_server_fails_over(engines: list[EngineProcess], reference) -> None:
    dead = dead_url()
    async with SGLangClient([dead, engines[0].url], backoff=0.01, unhealthy_after=1) as client:
        gens = await asyncio.gather(*(client.generate(p, {**GREEDY, "max_new_tokens": 5}, episode=f"x{i}")
                                      for i, p in enumerate(PROMPTS)))
        for p, g in zip(PROMPTS, gens, strict=True):
            assert g.output_ids.tolist() == hf_greedy(reference, p, 5) and g.server == engines[0].url
        assert client.stats.errors["ClientConnectorError"] >= 1
        assert client.servers[dead].healthy is False


async def test_all_servers_dead_is_a_server_error() -> None:
    async with SGLangClient([dead_url()], retries=2, backoff=0.01) as client:
        with pytest.raises(ServerError, match="failed after 3 attempts"):
            await client.generate([1, 2], {"max_new_tokens": 2})


@pytest.fixture
async def faulty(engines: list[EngineProcess]):
    """A proxy in front of a real engine that misbehaves once per fault, then forwards faithfully."""
    import aiohttp

    faults: list[str] = []
    hung = asyncio.Event()
    release = asyncio.Event()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fault = faults.pop(0) if faults else None
        if fault == "500":
            return web.Response(status=500, text="boom")
        if fault == "hang":
            hung.set()
            await release.wait()  # until the test ends: the client must give up on its own
        if fault == "garbage":
            return web.Response(text="<html>not json</html>")
        async with aiohttp.ClientSession() as s, s.post(engines[0].url + "/generate", json=body) as r:
            data = await r.json()
        if fault == "short_logprobs":
            data["meta_info"]["output_token_logprobs"].pop()
        return web.json_response(data)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", ok)
    app.router.add_get("/health", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", faults, hung
    release.set()
    await runner.cleanup()


@pytest.mark.parametrize("fault", ["500", "garbage", "short_logprobs", "hang"])
async def test_faulty_answers_are_retried(faulty, fault: str, reference) -> None:
    url, faults, _ = faulty
    faults.append(fault)
    async with SGLangClient([url], backoff=0.01, request_timeout=3.0, unhealthy_after=5) as client:
        gen = await client.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 6}, episode="f")
        assert gen.output_ids.tolist() == hf_greedy(reference, PROMPTS[0], 6)
        assert client.stats.retries == 1 and sum(client.stats.errors.values()) == 1
        if fault == "hang":
            assert client.stats.aborts_sent == 1


async def test_cancelled_request_is_aborted_on_the_server(engines: list[EngineProcess]) -> None:
    url = engines[1].url
    before = (await server_state(url))["aborted_reqs"]
    async with SGLangClient([url]) as client:
        call = asyncio.ensure_future(client.generate(PROMPTS[4], {**GREEDY, "max_new_tokens": 900}))
        await wait_for_tokens(url)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    # close() waited for the abort to be delivered; the engine stopped decoding it
    state = await server_state(url)
    assert state["aborted_reqs"] == before + 1 and state["num_running_reqs"] == 0


async def test_abort_mode_update_resumes_under_new_weights(engines: list[EngineProcess], reference) -> None:
    """Partial rollout, abort mode: the engine aborts, the client resends prompt + partial output."""
    url = engines[1].url
    other = perturbed(copy.deepcopy(reference), seed=1)
    ids = PROMPTS[3]
    async with SGLangClient([url]) as client:
        call = asyncio.ensure_future(client.generate(ids, {**GREEDY, "max_new_tokens": 300}))
        await wait_for_tokens(url)
        await post(url, "/pause_generation", {"mode": "abort"})
        state = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
        status, out = await post(url, "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [encode_named_tensors(state)], "weight_version": "1"})
        assert status == 200, out
        await post(url, "/continue_generation", {})
        gen = await asyncio.wait_for(call, 120)
    tokens, versions = gen.output_ids.tolist(), gen.versions.tolist()
    k = versions.index(1)
    assert gen.resumed == 1 and len(tokens) == 300 and k > 0
    assert set(versions[:k]) == {0} and set(versions[k:]) == {1}
    assert tokens[:k] == hf_greedy(reference, ids, k)
    assert tokens[k:] == hf_greedy(other, ids + tokens[:k], 300 - k)  # re-prefilled under the new weights
    restore = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    await post(url, "/update_weights_from_tensor",
               {"serialized_named_tensors": [encode_named_tensors(restore)], "weight_version": "0"})


def test_no_urls_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one server URL"):
        SGLangClient([])


async def test_version_listener(engines: list[EngineProcess]) -> None:
    seen: list[int] = []
    async with SGLangClient([engines[0].url]) as client:
        client.on_version(seen.append)
        await client.generate([1, 2], {"max_new_tokens": 1})
    assert seen == [0]
    assert isinstance(torch.__version__, str)


async def test_refresh_follows_the_engines_back_only_when_all_went_back(engines: list[EngineProcess]) -> None:
    heard: list[int] = []
    urls = [e.url for e in engines]

    async def versions(*vs: str) -> None:
        for url, v in zip(urls, vs, strict=True):
            assert (await post(url, "/update_weight_version", {"new_version": v}))[0] == 200

    try:
        async with SGLangClient(urls) as client:
            client.on_version(heard.append)
            await versions("7", "7")
            assert await client.refresh_version() == 7
            await versions("7", "4")  # one engine behind (a publish in progress): not a rollback
            assert await client.refresh_version() == 7
            await versions("4", "4")  # every engine went back: a trainer restarted from a checkpoint
            assert await client.refresh_version() == 4
            await client.generate([1, 2], {"max_new_tokens": 1})  # answers only ever move it forward
            assert heard == [7, 4] and client.latest_version == 4
    finally:
        await versions("0", "0")
