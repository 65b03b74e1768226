"""`/generate` requests that once cost every other client (a 25 MB text stalled the engine for 29 s,
bodies up to 2 GiB were read whole, `n` had no bound) or decoded for nobody (a client that went
away left its generation running): each is refused or stopped, and a normal request is served after."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from helpers import PROMPTS, post
from test_hostile_sampling import serves_normally

from slime_async.engine.server import GENERATE_MAX_BYTES


async def raw_post(url: str, data: bytes | object, **headers: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(url + "/generate", data=data, headers=headers) as resp:
        return resp.status, await resp.text()


async def server_state(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/get_server_info") as resp:
        return (await resp.json())["internal_states"][0]


async def test_an_oversized_body_is_refused_before_it_is_read(engine_url: str, reference: torch.nn.Module) -> None:
    body = b'{"input_ids": [' + b"1," * (GENERATE_MAX_BYTES // 2) + b'1]}'
    status, text = await raw_post(engine_url, body, **{"Content-Type": "application/json"})
    assert status == 413 and "at most" in text
    await serves_normally(engine_url, reference)


async def test_an_oversized_chunked_body_is_refused(engine_url: str, reference: torch.nn.Module) -> None:
    async def chunks():  # no Content-Length: the size is only known by reading
        yield b'{"input_ids": ['
        for _ in range(GENERATE_MAX_BYTES // 2**20 + 1):
            yield b"1," * 2**19
        yield b"1]}"

    status, text = await raw_post(engine_url, chunks(), **{"Content-Type": "application/json"})
    assert status == 413 and "over" in text
    await serves_normally(engine_url, reference)


async def test_a_text_that_cannot_fit_the_context_is_refused_untokenized(engine_url: str,
                                                                         reference: torch.nn.Module) -> None:
    status, out = await post(engine_url, "/generate", {"text": "7" * 4_000_000,
                                                       "sampling_params": {"max_new_tokens": 4}})
    assert status == 400 and "cannot fit the context length 1024" in out["error"]["message"]
    await serves_normally(engine_url, reference)


async def test_n_is_bounded_by_the_engine_s_batch(engine_url: str) -> None:
    status, out = await post(engine_url, "/generate", {"input_ids": PROMPTS[0],
                                                       "sampling_params": {"max_new_tokens": 4, "n": 100000}})
    assert status == 400 and "sampling_params.n: 100000; at most 6" in out["error"]["message"]


async def test_a_client_that_goes_away_stops_its_generation(engine_url: str, reference: torch.nn.Module) -> None:
    before = await server_state(engine_url)
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 900, "temperature": 1.0,
                                                         "ignore_eos": True}}
    task = asyncio.ensure_future(post(engine_url, "/generate", body))
    for _ in range(600):  # bounded: until the engine decodes it
        if (await server_state(engine_url))["num_running_reqs"] >= 1:
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the engine never started decoding")
    task.cancel()  # closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(500):  # bounded: the handler is cancelled and aborts it within a few steps
        state = await server_state(engine_url)
        if state["num_running_reqs"] == 0:
            break
        await asyncio.sleep(0.02)
    assert state["num_running_reqs"] == 0 and state["aborted_reqs"] == before["aborted_reqs"] + 1
    assert state["generated_tokens"] - before["generated_tokens"] < 900  # it never ran to its end
    await serves_normally(engine_url, reference)
