"""Conformance with SGLang 0.5.23's own source: endpoints and field names, read from its wheel with `ast`.

SGLang does not import here (its kernels need a GPU stack), but its request classes and routes
parse. The wheel is fetched once per machine with `pip download --no-deps` (PyPI only).
"""

from __future__ import annotations

import ast
from types import ModuleType

import msgspec
import pytest
from sglang_source import class_fields, routes

from slime_async.engine import protocol
from slime_async.engine.server import EngineServer

REQUEST_CLASSES = [
    protocol.GenerateReqInput,
    protocol.AbortReq,
    protocol.PauseGenerationReqInput,
    protocol.ContinueGenerationReqInput,
    protocol.UpdateWeightFromDiskReqInput,
    protocol.UpdateWeightsFromTensorReqInput,
    protocol.UpdateWeightVersionReqInput,
    protocol.ReleaseMemoryOccupationReqInput,
    protocol.ResumeMemoryOccupationReqInput,
    protocol.InitWeightsUpdateGroupReqInput,
    protocol.UpdateWeightsFromDistributedReqInput,
]


@pytest.mark.parametrize("cls", REQUEST_CLASSES, ids=lambda c: c.__name__)
def test_every_request_field_exists_in_sglang(sglang_source: dict[str, ast.Module], cls: type) -> None:
    ours = set(cls.__struct_fields__)
    theirs = class_fields(sglang_source["io"], cls.__name__)
    if cls is protocol.GenerateReqInput:  # the HTTP contract adds a few keys of its own
        theirs |= class_fields(sglang_source["api"], "GenerateRequest")
    assert ours - theirs == set(), f"{cls.__name__}: fields SGLang does not have"


def test_sampling_params_fields_exist_in_sglang(sglang_source: dict[str, ast.Module]) -> None:
    ours = set(protocol.SamplingParams.__struct_fields__)
    theirs = class_fields(sglang_source["sampling"], "SamplingParams") | class_fields(
        sglang_source["api"], "SamplingParams"
    )
    assert ours - theirs == set()


def test_every_endpoint_exists_in_sglang(sglang_source: dict[str, ast.Module], tiny_engine) -> None:
    server = EngineServer(tiny_engine, "m")
    ours = {r.resource.canonical for r in server.app.router.routes()}
    theirs = routes(sglang_source["http"]) | routes(sglang_source["v1_loads"])  # a router the app includes
    assert "/generate" in theirs and "/v1/loads" in theirs and len(theirs) > 30  # the parse found SGLang's routes
    assert ours - theirs == set()


def test_model_info_keys_exist_in_sglang(sglang_source: dict[str, ast.Module], tiny_engine) -> None:
    for node in ast.walk(sglang_source["http"]):
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "model_info":
            result = next(n.value for n in ast.walk(node) if isinstance(n, ast.Assign)
                          and isinstance(n.value, ast.Dict))
            theirs = {k.value for k in result.keys if isinstance(k, ast.Constant)}
            break
    else:
        raise AssertionError("no model_info in SGLang's http_server.py")
    import asyncio

    server = EngineServer(tiny_engine, "m")
    response = asyncio.run(server.model_info(None))  # type: ignore[arg-type]
    ours = set(msgspec.json.decode(response.body))
    assert ours == theirs


def test_loads_keys_exist_in_sglang(sglang_source: dict[str, ast.Module], tiny_engine) -> None:
    """`/v1/loads`: the top-level keys of SGLang's answer, and per rank the fields of its `LoadSnapshot`."""
    import asyncio

    theirs = class_fields(sglang_source["loads"], "LoadSnapshot")
    assert {"dp_rank", "num_running_reqs", "num_waiting_reqs"} <= theirs  # the two the client reads
    for node in ast.walk(sglang_source["v1_loads"]):
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "get_loads":
            result = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)]
            top = {k.value for k in result[-1].keys if isinstance(k, ast.Constant)}
            break
    else:
        raise AssertionError("no get_loads in SGLang's v1_loads.py")
    server = EngineServer(tiny_engine, "m")
    body = msgspec.json.decode(asyncio.run(server.loads(None)).body)  # type: ignore[arg-type]
    assert set(body) == top and set(body["loads"][0]) <= theirs


def test_weight_version_spans_have_sglangs_shape(sglang_source: dict[str, ast.Module]) -> None:
    """SGLang reports spans as dicts with version, start, end (end exclusive)."""
    assert class_fields(sglang_source["versions"], "WeightVersionSpan") == {"version", "start", "end"}
    from slime_async.engine.core import version_spans

    assert version_spans(["0", "0", "1", "1", "1"]) == [
        {"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5}
    ]


def test_every_sglang_generate_field_is_handled(sglang_api: ModuleType) -> None:
    """Each field of SGLang's /generate contract is implemented, refused when used, or a routing hint."""
    theirs = set(sglang_api.GenerateRequest.__struct_fields__)
    ours = set(protocol.GenerateReqInput.__struct_fields__) | protocol.IGNORED_GENERATE_FIELDS
    assert theirs - ours == set()
    assert set(sglang_api.SamplingParams.__struct_fields__) - set(protocol.SamplingParams.__struct_fields__) == set()


async def test_requests_and_responses_decode_with_sglangs_contract(sglang_api: ModuleType, aiohttp_engine: str) -> None:
    """Bodies as our tests and clients send them, and the engine's answers, through SGLang's own decoders."""
    import aiohttp

    requests = [
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
         "return_logprob": True, "rid": "a"},
        {"text": "What is 2 + 3?", "sampling_params": {"max_new_tokens": 3, "n": 2, "stop_token_ids": [5],
                                                       "stop": ["\n"], "top_p": 0.9, "top_k": 20, "min_p": 0.1}},
    ]
    async with aiohttp.ClientSession() as session:
        for body in requests:
            sglang_api.GenerateRequest.from_json_value(body)
            async with session.post(aiohttp_engine + "/generate", json=body) as resp:
                out = await resp.json()
            for item in out if isinstance(out, list) else [out]:
                decoded = sglang_api.GenerateResponse.from_json_value(item)
                assert decoded.output_ids == item["output_ids"]
                meta = decoded.meta_info
                assert meta.completion_tokens == len(item["output_ids"])
                assert meta.weight_versions[0].end == len(item["output_ids"])
        async with session.post(aiohttp_engine + "/generate", json={"input_ids": [10**9]}) as resp:
            assert resp.status == 400
            error = sglang_api.GenerateStreamError.from_json_value(await resp.json())
            assert "outside the vocabulary" in error.error.message
