"""Sampling requests and weights that once stopped the engine's loop for good (`/health` still 200,
every `/generate` hanging): each is answered, and a normal request is served after it."""

from __future__ import annotations

import asyncio
import copy
import math

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy, post

from slime_async.weight_wire.codec import encode_named_tensors


def sampled(ids: list[int], n: int = 8, **params: object) -> dict:
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, **params}}


async def serves_normally(url: str, reference: torch.nn.Module) -> None:
    status, out = await asyncio.wait_for(post(url, "/generate", greedy_body(PROMPTS[0], n=6)), 60)
    assert status == 200 and out["output_ids"] == hf_greedy(reference, PROMPTS[0], 6)
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/health_generate"):
            async with http.get(url + path) as resp:
                assert resp.status == 200, path


@pytest.mark.parametrize("params", [
    {"temperature": 1e-45},  # divides the logits into infinities: SGLang samples greedily under 1e-6
    {"top_k": 18446744073709551615},  # past any vocabulary: no top-k (it would not fit a tensor)
    {"temperature": 1e-45, "top_k": 5, "top_p": 0.5},
])  # fmt: skip
async def test_extreme_sampling_is_answered_and_the_engine_goes_on(engine_url: str, reference: torch.nn.Module,
                                                                   params: dict) -> None:
    status, out = await asyncio.wait_for(post(engine_url, "/generate", sampled(PROMPTS[1], **params)), 60)
    assert status == 200 and len(out["output_ids"]) == 8
    if params.get("temperature", 1.0) < 1e-6:  # greedy, as SGLang does it
        assert out["output_ids"] == hf_greedy(reference, PROMPTS[1], 8)
    assert all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    await serves_normally(engine_url, reference)


async def test_nan_weights_then_good_ones_bring_the_engine_back(engine_url: str, reference: torch.nn.Module) -> None:
    broken = copy.deepcopy(reference)
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    state = {k: v for k, v in broken.state_dict().items() if k != "lm_head.weight"}
    good = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    try:
        status, _ = await post(engine_url, "/update_weights_from_tensor",
                               {"serialized_named_tensors": [encode_named_tensors(state)], "weight_version": "0"})
        assert status == 200
        status, out = await asyncio.wait_for(post(engine_url, "/generate", sampled(PROMPTS[2])), 60)
        assert status == 200 and 1 <= len(out["output_ids"]) <= 8  # answered, with logprobs that say NaN
        assert all(0 <= t < reference.config.vocab_size for t in out["output_ids"])
        # NaN is no JSON: null in its place, as SGLang's orjson writes it
        assert any(lp is None for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    finally:
        status, _ = await post(engine_url, "/update_weights_from_tensor",
                               {"serialized_named_tensors": [encode_named_tensors(good)], "weight_version": "0"})
        assert status == 200
    await serves_normally(engine_url, reference)
