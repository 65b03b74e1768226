"""/generate over real HTTP against an engine process: exactness, batching, logprobs, versions."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import torch
from helpers import PROMPTS, greedy_body, hf_greedy, post, wait_for_tokens


async def test_greedy_equals_hf_generate(engine_url: str, reference: torch.nn.Module) -> None:
    for ids in PROMPTS:
        status, out = await post(engine_url, "/generate", greedy_body(ids))
        assert status == 200, out
        assert out["output_ids"] == hf_greedy(reference, ids, 24)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 24
        assert meta["finish_reason"] == {"type": "length", "length": 24}


async def test_concurrent_requests_match_one_at_a_time(engine_url: str, reference: torch.nn.Module) -> None:
    """Requests of different lengths join and leave one running batch; tokens must not change."""
    bodies = [greedy_body(ids, n=8 + 5 * i) for i, ids in enumerate(PROMPTS * 3)]
    results = await asyncio.gather(*(post(engine_url, "/generate", b) for b in bodies))
    for body, (status, out) in zip(bodies, results, strict=True):
        assert status == 200
        n = body["sampling_params"]["max_new_tokens"]
        assert out["output_ids"] == hf_greedy(reference, body["input_ids"], n)


async def test_logprobs_equal_a_reference_forward_pass(engine_url: str, reference: torch.nn.Module) -> None:
    """Sampled at temperature 0.7: logprob = log_softmax(logits / 0.7) of the sampled token (SGLang's)."""
    ids = PROMPTS[3]
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0.7, "ignore_eos": True}}
    status, out = await post(engine_url, "/generate", body)
    assert status == 200
    tokens = out["output_ids"]
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == tokens
    with torch.no_grad():
        logits = reference(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([t[0] for t in triples]), expected, atol=1e-4, rtol=0)


async def test_text_prompt_n_samples_and_stop_conditions(engine_url: str, reference: torch.nn.Module) -> None:
    ids = PROMPTS[1]
    greedy = hf_greedy(reference, ids, 24)
    # stop_token_ids: ends at the first occurrence, the stop token included in output_ids
    stop_at = greedy[5]
    status, out = await post(engine_url, "/generate", greedy_body(ids, sampling_params={
        "max_new_tokens": 24, "temperature": 0, "stop_token_ids": [stop_at]}))
    assert status == 200
    assert out["output_ids"] == greedy[: greedy.index(stop_at) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    # n samples come back as a list, each with its own id
    status, outs = await post(engine_url, "/generate", {
        "text": "What is 2 + 3?", "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0}})
    assert status == 200 and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert all(o["meta_info"]["completion_tokens"] >= 1 for o in outs)


async def test_streaming_sends_growing_outputs_then_done(engine_url: str, reference: torch.nn.Module) -> None:
    ids = PROMPTS[0]
    events = []
    async with aiohttp.ClientSession() as session, session.post(
        engine_url + "/generate", json={**greedy_body(ids, n=6), "stream": True}
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == hf_greedy(reference, ids, 6)
    # one event per token, each showing exactly the tokens so far (however far decoding has run)
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]


async def test_abort_by_rid_returns_partial_output(engine_url: str) -> None:
    body = greedy_body(PROMPTS[4], n=900, rid="long-one")
    request = asyncio.ensure_future(post(engine_url, "/generate", body))
    await wait_for_tokens(engine_url)
    status, _ = await post(engine_url, "/abort_request", {"rid": "long-one"})
    assert status == 200
    status, out = await asyncio.wait_for(request, 60)
    assert status == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 900
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
