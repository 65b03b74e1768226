"""The embedded engine behaves as SGLang 0.5.23 does, rule by rule, each pinned to SGLang's source.

Each test names the SGLang code it follows; the shapes are decoded with SGLang's own JSON contract
(`sglang/api/v1/api_types.py`) and fields and defaults are read from its wheel (`test_conformance`).
Behaviour is checked against a real engine process and the same weights in HF transformers.
"""

from __future__ import annotations

import ast
import asyncio
import json
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy, post, wait_for_tokens
from sglang_source import class_defaults, sglang_wheel
from test_conformance import REQUEST_CLASSES
from transformers import AutoTokenizer

from slime_async.engine import protocol


@pytest.fixture(scope="module")
def tokenizer(varied_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(varied_model_dir)


def decoded(sglang_api: ModuleType, out: Any) -> list[Any]:
    """The reply through SGLang's own response decoder (a list for a batch or n > 1)."""
    return [sglang_api.GenerateResponse.from_json_value(o) for o in (out if isinstance(out, list) else [out])]


# --- control bodies (io_struct.py: BaseReq and each *ReqInput) ----------------------------------


def _literal(expr: ast.expr | None) -> Any:
    return ast.literal_eval(expr) if expr is not None else None


REQUIRED = {"model_path": "/nowhere", "serialized_named_tensors": [], "new_version": "7", "names": [], "dtypes": [],
            "shapes": [], "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}


@pytest.mark.parametrize("cls", [c for c in REQUEST_CLASSES if c is not protocol.GenerateReqInput],
                         ids=lambda c: c.__name__)
def test_control_bodies_take_every_sglang_field_at_its_default(sglang_source: dict[str, ast.Module],
                                                               cls: type) -> None:
    """A body that sets every field SGLang declares to SGLang's own default parses here, and each of
    our defaults is SGLang's."""
    theirs = class_defaults(sglang_source["io"], cls.__name__)
    body = {name: REQUIRED[name] if default is None and name in REQUIRED else _literal(default)
            for name, default in theirs.items()}
    parsed = protocol.decode_body(json.dumps(body).encode(), cls)
    for name in cls.__struct_fields__:
        if theirs[name] is not None:
            assert getattr(cls(**{k: v for k, v in REQUIRED.items() if k in cls.__struct_fields__}), name) == \
                _literal(theirs[name]), f"{cls.__name__}.{name}: our default differs from SGLang's"
    assert protocol.refused_update_fields(parsed) == []


async def test_control_bodies_with_sglangs_optional_fields_are_served(engine_url: str) -> None:
    for path, body in [
        ("/abort_request", {"rid": "nothing-runs", "abort_all": False, "finished_reason": None, "abort_message": None,
                            "weight_versions": None, "http_worker_ipc": None}),
        ("/pause_generation", {"mode": "in_place", "rid": None}),
        ("/continue_generation", {"torch_empty_cache": True, "rid": None, "http_worker_ipc": None}),
        ("/update_weight_version", {"new_version": "0", "abort_all_requests": True, "rid": "x"}),
    ]:
        status, out = await post(engine_url, path, body)
        assert status == 200, (path, out)
    status, out = await post(engine_url, "/update_weights_from_tensor", {"serialized_named_tensors": [],
                                                                         "selector": "draft"})
    assert status == 400 and "selector" in out["message"]
    # unknown keys are ignored (SGLang decodes these bodies with extra_behavior="ignore"); no body is a 400
    assert (await post(engine_url, "/abort_request", {"rid": "x", "from_a_newer_sglang": 1}))[0] == 200
    async with aiohttp.ClientSession() as session, session.post(engine_url + "/continue_generation") as resp:
        assert resp.status == 400


# --- batch input (io_struct.py: normalize_batch_and_arguments; tokenizer_manager: _handle_batch_request) ---


async def test_a_batch_gets_one_result_per_prompt_in_order(engine_url: str, reference: torch.nn.Module,
                                                           sglang_api: ModuleType) -> None:
    prompts = PROMPTS[:3]
    body = {"input_ids": prompts, "rid": "b", "return_logprob": [True, False, True],
            "sampling_params": [{"max_new_tokens": 4 + i, "temperature": 0, "ignore_eos": True} for i in range(3)]}
    sglang_api.GenerateRequest.from_json_value(body)  # a valid SGLang request
    status, out = await post(engine_url, "/generate", body)
    assert status == 200, out
    assert [o.meta_info.id for o in decoded(sglang_api, out)] == ["b_0", "b_1", "b_2"]
    for i, (ids, result) in enumerate(zip(prompts, out, strict=True)):
        assert result["output_ids"] == hf_greedy(reference, ids, 4 + i)
        assert ("output_token_logprobs" in result["meta_info"]) == (i != 1)

    # text as a list, each prompt sampled twice: prompt by prompt, its samples together
    texts = ["What is 2 + 3?", "Hello"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0, "ignore_eos": True}}
    status, out = await post(engine_url, "/generate", body)
    assert status == 200 and len(out) == 4
    lengths = [o.meta_info.prompt_tokens for o in decoded(sglang_api, out)]
    assert lengths[0] == lengths[1] and lengths[2] == lengths[3] and lengths[0] != lengths[2]
    assert out[0]["output_ids"] == out[1]["output_ids"]  # greedy: both samples of one prompt agree


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rid"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "rid"),
    ({"input_ids": [[1, 2], 3]}, "input_ids"),
    ({"input_ids": [1, 2], "rid": ["a"]}, "rid"),
    ({"text": []}, "text"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "return_logprob": [True, True], "sampling_params": {"n": 2}}, "return_logprob"),
    ({"input_ids": [[1], [10**9]]}, "input_ids[1]"),
])
async def test_malformed_batches_get_400_naming_the_field(engine_url: str, body: dict, field: str) -> None:
    status, out = await post(engine_url, "/generate", body)
    assert status == 400 and out["error"]["message"].startswith(field), out


# --- prompt logprobs (scheduler.py: logprob_start_len; logprob_result_processor.py) -------------


async def test_input_token_logprobs_score_the_prompt(engine_url: str, reference: torch.nn.Module,
                                                     sglang_api: ModuleType) -> None:
    """SGLang's prompt scoring (its frontend's `select`): max_new_tokens 0, logprob_start_len k gives
    each prompt token from k on with its logprob given the tokens before it, the first as None."""
    ids = PROMPTS[3]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    for start in (0, 2, len(ids)):
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0}}
        status, out = await post(engine_url, "/generate", body)
        assert status == 200, out
        meta = decoded(sglang_api, out)[0].meta_info
        assert out["output_ids"] == [] and out["text"] == "" and meta.completion_tokens == 0
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        entries = out["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:]
        if entries:
            assert entries[0][0] is None
            expected = [logprobs[j - 1, ids[j]].item() for j in range(start + 1, len(ids))]
            torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), torch.tensor(expected),
                                       atol=1e-4, rtol=0)
    # without logprob_start_len: the output's logprobs only, and asking for the prompt's changes no token
    status, plain = await post(engine_url, "/generate", greedy_body(ids, 8))
    assert plain["meta_info"]["input_token_logprobs"] == []
    assert plain["meta_info"]["output_token_logprobs_length"] == 8
    status, scored = await post(engine_url, "/generate", greedy_body(ids, 8, logprob_start_len=0))
    assert scored["output_ids"] == plain["output_ids"] == hf_greedy(reference, ids, 8)
    status, out = await post(engine_url, "/generate", greedy_body(ids, 8, logprob_start_len=len(ids) + 1))
    assert status == 400 and "logprob_start_len" in out["error"]["message"]


# --- stops (schedule_batch.py: update_finish_state; detokenizer_manager.py: trim_matched_stop) ----


def _stop_inside_a_token(tokenizer: Any, tokens: list[int]) -> tuple[str, int]:
    """A two-character stop string from inside one generated token's text, found nowhere before it."""
    for k in range(1, len(tokens)):
        piece = tokenizer.decode(tokens[k : k + 1])
        before = tokenizer.decode(tokens[:k])
        for a in range(1, len(piece) - 2):
            stop = piece[a : a + 2]
            if stop.strip() and stop not in before + piece[: a + 1]:
                return stop, k
    raise AssertionError("no generated token has three characters")


async def test_stop_strings_end_generation_and_are_trimmed_from_the_text(engine_url: str, tokenizer: Any,
                                                                         reference: torch.nn.Module) -> None:
    ids = PROMPTS[1]
    greedy = hf_greedy(reference, ids, 48)
    stop, k = _stop_inside_a_token(tokenizer, greedy)
    for no_trim in (False, True):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "stop": [stop],
                                                      "no_stop_trim": no_trim}}
        status, out = await post(engine_url, "/generate", body)
        assert status == 200, out
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == greedy[: k + 1]  # every generated token, the one holding the stop too
        full = tokenizer.decode(greedy[: k + 1])
        cut = full.index(stop) + (len(stop) if no_trim else 0)
        assert out["text"] == full[:cut] and len(out["text"]) < len(full)


async def test_a_stop_token_is_left_out_of_the_text_and_ignore_eos_ignores_it(engine_url: str, tokenizer: Any,
                                                                              reference: torch.nn.Module) -> None:
    ids = PROMPTS[0]
    greedy = hf_greedy(reference, ids, 24)
    stop_at = greedy[6]
    params = {"max_new_tokens": 24, "temperature": 0, "stop_token_ids": [stop_at], "skip_special_tokens": False}
    _, out = await post(engine_url, "/generate", {"input_ids": ids, "sampling_params": params})
    kept = greedy[: greedy.index(stop_at) + 1]
    assert out["output_ids"] == kept and out["text"] == tokenizer.decode(kept[:-1])
    _, out = await post(engine_url, "/generate", {"input_ids": ids, "sampling_params": {**params,
                                                                                          "no_stop_trim": True}})
    assert out["text"] == tokenizer.decode(kept)
    # SGLang's _check_token_based_finish returns at once under ignore_eos: stop tokens are ignored too
    _, out = await post(engine_url, "/generate", {"input_ids": ids, "sampling_params": {**params,
                                                                                          "ignore_eos": True}})
    assert out["output_ids"] == greedy and out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


# --- sampling_params.verify and fields the engine does not have ---------------------------------


@pytest.mark.parametrize("top_k, status", [(0, 400), (-2, 400), (-1, 200), (1, 200)])
async def test_top_k_follows_sglangs_rule(engine_url: str, top_k: int, status: int) -> None:
    got, out = await post(engine_url, "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "top_k": top_k}})
    assert got == status, out
    if status == 400:
        assert "top_k must be -1 (disable) or at least 1" in out["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"watermark": {"enabled": True}}, "watermark"),
    ({"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
    ({"sampling_params": {"watermark": {"enabled": True}}}, "sampling_params.watermark"),
])
async def test_features_the_engine_lacks_are_named(engine_url: str, body: dict, field: str) -> None:
    status, out = await post(engine_url, "/generate", {"input_ids": [1, 2], **body})
    assert status == 400 and out["error"]["message"].startswith(field), out
    neutral = {k: None for k in body if k != "sampling_params"}
    status, out = await post(engine_url, "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 1}, **neutral})
    assert status == 200, out


# --- streaming (tokenizer_manager.py: _stream_batch_responses) -----------------------------------


async def _events(url: str, body: dict) -> list[dict]:
    events = []
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_streamed_samples_carry_their_index(engine_url: str, reference: torch.nn.Module,
                                                  sglang_api: ModuleType) -> None:
    ids = PROMPTS[2]
    chunks = await _events(engine_url, {**greedy_body(ids, 5), "stream": True,
                                        "sampling_params": {"max_new_tokens": 5, "n": 2, "temperature": 0,
                                                            "ignore_eos": True}})
    decoded(sglang_api, chunks)
    by_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_index) == [0, 1]
    for samples in by_index.values():
        lengths = [len(c["output_ids"]) for c in samples]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 5  # growing, one event per token at most
        assert samples[-1]["output_ids"] == hf_greedy(reference, ids, 5)
        assert samples[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert [c["meta_info"]["finish_reason"] for c in samples[:-1]] == [None] * (len(samples) - 1)
        # SGLang's detokenizer holds back a chunk that ends inside a character
        assert not any(c["text"].endswith("\ufffd") for c in samples[:-1])
    single = await _events(engine_url, {**greedy_body(ids, 9), "stream": True,
                                        "sampling_params": {"max_new_tokens": 9, "temperature": 0,
                                                            "ignore_eos": True, "stream_interval": 4}})
    assert all("index" not in c for c in single)
    assert all(len(c["output_ids"]) % 4 == 0 for c in single[:-1]) and len(single[-1]["output_ids"]) == 9


# --- abort (schedule_batch.py: FINISH_ABORT; scheduler.py: abort_request's prefix match) ---------


async def test_an_abort_names_a_live_request_and_ends_it_with_sglangs_finish_reason(
        engine_url: str, sglang_api: ModuleType) -> None:
    """SGLang forwards an abort only for the id of a live request (here a batch's `grp_0`, not the
    batch's own `grp`), and `abort_all` ends everything; either way the partial output comes back."""
    body = {"input_ids": [PROMPTS[0], PROMPTS[1]], "rid": "grp",
            "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
    request = asyncio.ensure_future(post(engine_url, "/generate", body))
    await wait_for_tokens(engine_url, running=2)
    assert (await post(engine_url, "/abort_request", {"rid": "grp"}))[0] == 200
    async with aiohttp.ClientSession() as session, session.get(engine_url + "/get_server_info") as resp:
        assert (await resp.json())["internal_states"][0]["num_running_reqs"] == 2  # no live request is "grp"
    assert (await post(engine_url, "/abort_request", {"rid": "grp_0"}))[0] == 200
    assert (await post(engine_url, "/abort_request", {"abort_all": True}))[0] == 200
    status, out = await asyncio.wait_for(request, 60)
    assert status == 200 and len(out) == 2
    fields = set(sglang_api.FinishAbort.__struct_fields__) | {"type"}
    for result in out:
        reason = result["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert set(reason) == fields
        assert 0 < result["meta_info"]["completion_tokens"] < 900


# --- /server_info (http_server.py: server_info; utils/common.py: build_server_info) --------------


def test_server_info_holds_what_sglangs_tools_read(sglang_wheel_fields: set[str], tiny_engine) -> None:
    from slime_async.engine.server import EngineServer

    server = EngineServer(tiny_engine, "/models/tiny")
    info = json.loads(asyncio.run(server.server_info(None)).body)  # type: ignore[arg-type]
    # read by SGLang's own tools (bench_serving, the router, its tests)
    for key in ("version", "tokenizer_path", "served_model_name", "page_size", "disable_radix_cache",
                "speculative_eagle_topk", "internal_states"):
        assert key in info, key
    assert info["tokenizer_path"] == info["served_model_name"] == "/models/tiny"
    assert set(info) - sglang_wheel_fields == {"engine"}


@pytest.fixture(scope="module")
def sglang_wheel_fields() -> set[str]:
    """Every key SGLang's /server_info can hold: its server arguments (`arg_groups/fields`), the
    scheduler's init info and what the HTTP handler adds."""
    keys = {"launch_command", "kv_events"}
    with zipfile.ZipFile(sglang_wheel()) as wheel:
        for name in wheel.namelist():
            if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                for node in ast.walk(ast.parse(wheel.read(name))):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        keys.add(node.target.id)
        for path, function in (("sglang/srt/managers/scheduler.py", "get_init_info"),
                               ("sglang/srt/entrypoints/http_server.py", "server_info")):
            tree = ast.parse(wheel.read(path))
            fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.name == function)
            for node in ast.walk(fn):
                if isinstance(node, ast.Dict):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    assert {"model_path", "page_size", "max_req_input_len", "version"} <= keys  # the parse found them
    return keys


# --- defaults, ids, routes (sampling_params.py __post_init__; tokenizer_manager.py; http_server.py) ---


async def test_null_is_each_fields_default_and_max_new_tokens_fits_the_context(engine_url: str,
                                                                               reference: torch.nn.Module) -> None:
    ids = PROMPTS[1]
    status, out = await post(engine_url, "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "top_p": None, "top_k": None, "n": None, "ignore_eos": True,
        "skip_special_tokens": None, "stop": None}})
    assert status == 200 and out["output_ids"] == hf_greedy(reference, ids, 6)
    long = [3 + i % 200 for i in range(1000)]  # 1,000 of the engine's 1,024 positions
    status, out = await post(engine_url, "/generate", {"input_ids": long, "sampling_params": {
        "temperature": 0, "ignore_eos": True}})  # absent: 128, clamped to the 24 left
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    status, out = await post(engine_url, "/generate", {"input_ids": long[:900], "sampling_params": {
        "temperature": 0, "ignore_eos": True, "max_new_tokens": None}})  # null: to the context's end
    assert status == 200 and len(out["output_ids"]) == 124
    status, out = await post(engine_url, "/generate", {"input_ids": long, "sampling_params": {"max_new_tokens": 25}})
    assert status == 400 and "max_new_tokens" in out["error"]["message"]
    status, out = await post(engine_url, "/generate", {"input_ids": [3 + i % 200 for i in range(1024)],
                                                       "sampling_params": {"max_new_tokens": 0}})
    assert status == 400 and "longer than the model's context length" in out["error"]["message"]


async def test_text_is_tokenized_as_the_tokenizer_does_by_default(engine_url: str, tokenizer: Any) -> None:
    """SGLang calls the tokenizer with its special tokens (a BOS where the model has one)."""
    text = "What is 2 + 3?"
    status, out = await post(engine_url, "/generate", {"text": text, "return_prompt_token_ids": True,
                                                       "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and out["prompt_token_ids"] == tokenizer(text).input_ids
    assert out["meta_info"]["prompt_tokens"] == len(out["prompt_token_ids"])


async def test_a_request_id_in_use_is_refused(engine_url: str) -> None:
    request = asyncio.ensure_future(post(engine_url, "/generate", {**greedy_body(PROMPTS[0], 400), "rid": "twice"}))
    await wait_for_tokens(engine_url)
    status, out = await post(engine_url, "/generate", {**greedy_body(PROMPTS[1], 4), "rid": "twice"})
    assert status == 400 and out["error"]["message"] == "Duplicate request ID detected: twice"
    await post(engine_url, "/abort_request", {"rid": "twice"})
    assert (await asyncio.wait_for(request, 60))[0] == 200
    assert (await post(engine_url, "/generate", {**greedy_body(PROMPTS[1], 4), "rid": "twice"}))[0] == 200


async def test_an_empty_stop_string_stops_at_once(engine_url: str) -> None:
    status, out = await post(engine_url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 8, "stop": [""]}})
    assert status == 200 and len(out["output_ids"]) == 1 and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ""}


async def test_a_stream_refused_after_the_contract_check_sends_an_error_event(engine_url: str) -> None:
    events = await _events(engine_url, {"input_ids": [1, 2], "stream": True, "sampling_params": {"top_k": 0}})
    assert events == [{"error": {"message": "sampling_params.top_k must be -1 (disable) or at least 1, got 0",
                                 "type": "invalid_request_error", "code": 400, "retryable": False}}]
    status, _ = await post(engine_url, "/generate", {"input_ids": "x", "stream": True})
    assert status == 400  # the contract check itself still answers 400


async def test_routes_take_sglangs_methods(engine_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(engine_url + "/generate") as resp:
            assert resp.status == 405
        async with session.put(engine_url + "/generate", json={"input_ids": [1], "sampling_params": {
                "max_new_tokens": 1}}) as resp:
            assert resp.status == 200
        async with session.get(engine_url + "/flush_cache") as resp:  # idle: flushed
            assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")


async def test_a_request_aborted_in_the_queue_gets_sglangs_short_reply(engine_url: str) -> None:
    """The engine's batch is 6: the seventh request waits in the queue; aborting it there answers as
    SGLang's `_handle_abort_req` does (type and message, no prompt or cache counts)."""
    running = [asyncio.ensure_future(post(engine_url, "/generate", {**greedy_body(PROMPTS[0], 900), "rid": f"r{i}"}))
               for i in range(6)]
    await wait_for_tokens(engine_url, running=6)
    queued = asyncio.ensure_future(post(engine_url, "/generate", {**greedy_body(PROMPTS[1], 900), "rid": "queued"}))
    async with aiohttp.ClientSession() as session:
        for _ in range(1500):  # bounded: until the engine reports it waiting
            async with session.get(engine_url + "/get_server_info") as resp:
                if (await resp.json())["internal_states"][0]["num_waiting_reqs"] == 1:
                    break
    assert (await post(engine_url, "/abort_request", {"rid": "queued"}))[0] == 200
    status, out = await asyncio.wait_for(queued, 60)
    assert status == 200
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert "prompt_tokens" not in out["meta_info"] and out["meta_info"]["output_token_logprobs"] == []
    await post(engine_url, "/abort_request", {"abort_all": True})
    await asyncio.wait_for(asyncio.gather(*running), 60)
