"""Bad requests get a 400 naming the problem; the server keeps serving and in-flight work is unharmed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy, post, wait_for_tokens

from slime_async.engine.server import EngineServer


async def raw_post(url: str, path: str, data: bytes, **headers: str) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **headers}
    async with aiohttp.ClientSession() as session, session.post(url + path, data=data, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/generate", b"{not json", "malformed JSON body"),
        ("/generate", b'{"input_ids": [1], "image_data": "x.png"}', "image_data: not supported by the embedded engine"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"regex": "a+", "frequency_penalty": 0.5}}',
         "sampling_params.frequency_penalty, sampling_params.regex: not supported"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"temprature": 1}}', "unknown field `temprature`"),
        ("/generate", b'{"input_ids": [1, 2, 100000]}', "input_ids: token 100000 is outside the vocabulary"),
        ("/generate", b'{"input_ids": [1, -1]}', "token -1 is outside the vocabulary"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}',
         "1 prompt tokens + 5000 new tokens exceed the context length 1024"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": -0.5}}',
         "Expected `float` >= 0.0 - at `$.sampling_params.temperature`"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "$.sampling_params.top_p"),
        ("/generate", b'{"input_ids": "abc"}', "$.input_ids"),
        ("/generate", b'{"input_ids": [1], "text": "hi"}', "give exactly one of text and input_ids"),
        ("/generate", b'{"input_ids": []}', "input_ids cannot be empty"),  # SGLang's words
        ("/generate", b"{}", "give exactly one of text and input_ids"),
        ("/pause_generation", b'{"mode": "sideways"}', "$.mode"),
        ("/abort_request", b'{"rid": 5}', "$.rid"),
    ],
)
async def test_bad_requests_get_400_naming_the_field(engine_url: str, path: str, body: bytes, message: str) -> None:
    status, out = await raw_post(engine_url, path, body)
    assert status == 400
    assert message in out["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"serialized_named_tensors": ["%%%"]}',
         "Invalid base64 encoded string - at `$.serialized_named_tensors[0]`"),
        (b'{"serialized_named_tensors": ["aGVsbG8="]}', "serialized_named_tensors[0]: not base64"),
        (b'{"serialized_named_tensors": "x"}', "$.serialized_named_tensors"),
        (b'{"weight_version": "2"}', "missing required field `serialized_named_tensors`"),
    ],
)
async def test_bad_weight_updates_get_400(engine_url: str, body: bytes, message: str) -> None:
    status, out = await raw_post(engine_url, "/update_weights_from_tensor", body)
    assert status == 400 and out["success"] is False and message in out["message"]


async def test_server_keeps_serving_and_in_flight_requests_survive(engine_url: str, reference: torch.nn.Module) -> None:
    ids = PROMPTS[3]
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(ids, n=200)))
    await wait_for_tokens(engine_url)
    for body in (b"{", b'{"input_ids": [999999]}', b'{"input_ids": [1], "sampling_params": {"n": 0}}'):
        assert (await raw_post(engine_url, "/generate", body))[0] == 400
    _, out = await asyncio.wait_for(request, 120)
    assert out["output_ids"] == hf_greedy(reference, ids, 200)


async def test_distributed_update_is_a_clear_501(engine_url: str) -> None:
    for path in ("/init_weights_update_group", "/update_weights_from_distributed"):
        status, out = await post(engine_url, path, {})
        assert status == 501 and "not supported by the embedded engine" in out["message"]


async def test_admin_endpoints_need_the_token_off_loopback(aiohttp_engine) -> None:
    """Bound to a public address, weight/pause/flush endpoints refuse requests without the token."""
    url = aiohttp_engine
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/update_weight_version", json={"new_version": "5"}) as r:
            assert r.status == 401 and "needs the admin token" in (await r.json())["error"]["message"]
        async with s.post(url + "/update_weight_version", json={"new_version": "5"},
                          headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.post(url + "/update_weight_version", json={"new_version": "5"},
                          headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
        async with s.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 200 and (await r.json())["meta_info"]["weight_version"] == "5"


async def test_a_token_with_non_ascii_characters_is_a_401_not_a_500(aiohttp_engine) -> None:
    status, out = await raw_post(aiohttp_engine, "/update_weight_version", b'{"new_version": "5"}',
                                 Authorization="Bearer \u00e9t\u00e9".encode().decode("latin-1"))
    assert status == 401 and "needs the admin token" in out["error"]["message"]


@pytest.mark.parametrize(("headers", "status", "message"), [
    # what a web page on another site can make a browser send without asking first
    ({"Content-Type": "text/plain", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, 403,
     "a browser request from another site"),
    ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403, "from origin 'http://evil.example'"),
    ({"Content-Type": "application/json", "Origin": "null"}, 403, "an opaque origin"),
    ({"Content-Type": "text/plain"}, 415, "Content-Type must be application/json, got 'text/plain'"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "got 'application/x-www-form-urlencoded'"),
])  # fmt: skip
async def test_a_loopback_engine_does_not_obey_a_web_page(engine_url: str, reference: torch.nn.Module,
                                                          headers: dict, status: int, message: str) -> None:
    # loopback needs no token: a page the user visits must still not pause it or load weights into it
    for path, body in (("/pause_generation", b'{"mode": "abort"}'),
                       ("/update_weights_from_disk", b'{"model_path": "/tmp/x"}')):
        got, out = await raw_post(engine_url, path, body, **headers)
        assert got == status and message in out["error"]["message"], (path, out)
    async with aiohttp.ClientSession() as s, s.get(engine_url + "/get_server_info") as r:
        assert (await r.json())["internal_states"][0]["paused"] is False
    # the engine's own host as the origin (a page it served) and programs (no Origin) are obeyed
    host = engine_url.removeprefix("http://")
    got, _ = await raw_post(engine_url, "/continue_generation", b"{}", Origin=f"http://{host}")
    assert got == 200
    status, out = await post(engine_url, "/generate", greedy_body(PROMPTS[0], n=4))
    assert status == 200 and out["output_ids"] == hf_greedy(reference, PROMPTS[0], 4)


def test_public_bind_without_token_is_refused(tiny_engine) -> None:
    with pytest.raises(ValueError, match="requires an admin token"):
        EngineServer(tiny_engine, "m", host="0.0.0.0")
    EngineServer(tiny_engine, "m", host="::1")  # loopback needs none
