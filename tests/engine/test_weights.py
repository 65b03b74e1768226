"""In-place weight updates over HTTP: exact effect, per-token versions across an update, all-or-nothing."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import PROMPTS, greedy_body, hf_greedy, perturbed, post, wait_for_tokens

from slime_async.weight_wire.codec import encode_named_tensors


@pytest.fixture(scope="module")
def other(reference: torch.nn.Module) -> torch.nn.Module:
    """A second set of weights (same shapes), as a trainer's next version would be."""
    return perturbed(copy.deepcopy(reference), seed=1)


def tensor_body(model: torch.nn.Module, version: str, **extra: object) -> dict:
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    names = sorted(state)
    half = len(names) // 2  # two buckets, as `sync` sends them
    return {
        "serialized_named_tensors": [
            encode_named_tensors({n: state[n] for n in names[:half]}),
            encode_named_tensors({n: state[n] for n in names[half:]}),
        ],
        "weight_version": version,
        **extra,
    }


async def set_weights(url: str, model: torch.nn.Module, version: str, **extra: object) -> None:
    status, out = await post(url, "/update_weights_from_tensor", tensor_body(model, version, **extra))
    assert status == 200 and out["success"], out


async def test_tensor_update_changes_output_exactly_as_predicted(
    engine_url: str, reference: torch.nn.Module, other: torch.nn.Module
) -> None:
    ids = PROMPTS[1]
    before, after = hf_greedy(reference, ids, 16), hf_greedy(other, ids, 16)
    assert before != after
    await set_weights(engine_url, other, "1")
    status, out = await post(engine_url, "/generate", greedy_body(ids, n=16))
    assert status == 200 and out["output_ids"] == after
    assert out["meta_info"]["weight_version"] == "1"
    assert out["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 16}]
    _, info = await post(engine_url, "/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    assert info["new_version"] == "7"
    async with aiohttp.ClientSession() as s, s.get(engine_url + "/get_model_info") as r:
        assert (await r.json())["weight_version"] == "7"
    await set_weights(engine_url, reference, "0")
    _, out = await post(engine_url, "/generate", greedy_body(ids, n=16))
    assert out["output_ids"] == before


async def test_disk_update(engine_url: str, reference: torch.nn.Module, other: torch.nn.Module, tmp_path: Path) -> None:
    other.save_pretrained(tmp_path)
    status, out = await post(engine_url, "/update_weights_from_disk",
                             {"model_path": str(tmp_path), "weight_version": "3"})
    assert status == 200 and out["success"] and out["num_paused_requests"] == 0, out
    _, gen = await post(engine_url, "/generate", greedy_body(PROMPTS[2], n=12))
    assert gen["output_ids"] == hf_greedy(other, PROMPTS[2], 12)
    status, out = await post(engine_url, "/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
    assert status == 400 and "no safetensors weights" in out["message"]
    await set_weights(engine_url, reference, "0")


async def test_an_unpaused_update_waits_for_the_running_requests(
    engine_url: str, reference: torch.nn.Module, other: torch.nn.Module
) -> None:
    """No pause: as SGLang's model-update lock has it, the update waits until the running request has
    finished (every token of it from version 0), then applies; a request sent after it sees version 1."""
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(PROMPTS[4], n=600)))
    await wait_for_tokens(engine_url)
    await set_weights(engine_url, other, "1")
    assert request.done()  # the update answered only after the request had finished
    _, out = await request
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 600}]
    _, after = await post(engine_url, "/generate", greedy_body(PROMPTS[2], n=8))
    assert after["meta_info"]["weight_version"] == "1" and after["output_ids"] == hf_greedy(other, PROMPTS[2], 8)
    await set_weights(engine_url, reference, "0")


async def test_an_in_place_paused_update_splits_versions(
    engine_url: str, reference: torch.nn.Module, other: torch.nn.Module
) -> None:
    """Paused in place, the update applies at once, between two decode steps: the request's tokens after
    it carry the new version. Its cache flush is refused while the request runs (SGLang's rule): an
    update that asks for one applies the weights and says it did not flush."""
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(PROMPTS[4], n=600)))
    await wait_for_tokens(engine_url)
    assert (await post(engine_url, "/pause_generation", {"mode": "in_place"}))[0] == 200
    status, out = await post(engine_url, "/update_weights_from_tensor", tensor_body(other, "1"))
    assert status == 400 and not out["success"] and "the cache was not flushed" in out["message"]
    await set_weights(engine_url, other, "1", flush_cache=False)
    assert (await post(engine_url, "/continue_generation", {}))[0] == 200
    _, out = await asyncio.wait_for(request, 120)
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 600
    assert 0 < spans[0]["end"] < 600
    await set_weights(engine_url, reference, "0")


async def test_retract_update_continue_recomputes_under_new_weights(
    engine_url: str, reference: torch.nn.Module, other: torch.nn.Module
) -> None:
    """retract re-queues the request; it resumes by re-prefilling its output under the new weights."""
    ids = PROMPTS[3]
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(ids, n=400)))
    await wait_for_tokens(engine_url)
    assert (await post(engine_url, "/pause_generation", {"mode": "retract"}))[0] == 200
    await set_weights(engine_url, other, "1")
    assert (await post(engine_url, "/continue_generation", {}))[0] == 200
    _, out = await asyncio.wait_for(request, 120)
    tokens, spans = out["output_ids"], out["meta_info"]["weight_versions"]
    k = spans[0]["end"]
    assert [s["version"] for s in spans] == ["0", "1"] and 0 < k < 400
    assert tokens[:k] == hf_greedy(reference, ids, k)
    assert tokens[k:] == hf_greedy(other, ids + tokens[:k], 400 - k)
    await set_weights(engine_url, reference, "0")


async def test_pause_abort_returns_partial_outputs(engine_url: str) -> None:
    requests = [asyncio.ensure_future(post(engine_url, "/generate", greedy_body(p, n=700))) for p in PROMPTS[:2]]
    await wait_for_tokens(engine_url, running=2)
    assert (await post(engine_url, "/pause_generation", {"mode": "abort"}))[0] == 200
    outs = await asyncio.wait_for(asyncio.gather(*requests), 60)
    for _, out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < 700
    assert (await post(engine_url, "/continue_generation", {}))[0] == 200
    status, out = await post(engine_url, "/generate", greedy_body(PROMPTS[0], n=3))
    assert status == 200 and len(out["output_ids"]) == 3


async def test_in_place_pause_keeps_requests(engine_url: str, other: torch.nn.Module, reference) -> None:
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(PROMPTS[0], n=500)))
    await wait_for_tokens(engine_url)
    await post(engine_url, "/pause_generation", {"mode": "in_place"})
    await set_weights(engine_url, other, "1", flush_cache=False)
    await post(engine_url, "/continue_generation", {})
    _, out = await asyncio.wait_for(request, 120)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["0", "1"]
    await set_weights(engine_url, reference, "0")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update({"model.no_such.weight": torch.zeros(3)}), "unknown weight name 'model.no_such.weight'"),
        (lambda s: s.update({"model.norm.weight": torch.zeros(7)}), "has shape (7,), the model's is"),
    ],
)
async def test_bad_update_is_all_or_nothing_and_harms_no_request(
    engine_url: str, reference: torch.nn.Module, other: torch.nn.Module, mutate, message: str
) -> None:
    ids = PROMPTS[1]
    request = asyncio.ensure_future(post(engine_url, "/generate", greedy_body(ids, n=300)))
    await wait_for_tokens(engine_url)
    state = dict(other.state_dict())
    mutate(state)  # valid new weights plus one bad tensor: nothing may change
    body = {"serialized_named_tensors": [encode_named_tensors(state)], "weight_version": "9"}
    status, out = await post(engine_url, "/update_weights_from_tensor", body)
    assert status == 400 and not out["success"] and message in out["message"]
    _, done = await asyncio.wait_for(request, 120)
    assert done["output_ids"] == hf_greedy(reference, ids, 300)
    assert done["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 300}]


async def test_an_update_with_a_tensor_without_data_changes_nothing(engine_url: str, reference: torch.nn.Module,
                                                                    other: torch.nn.Module) -> None:
    # SGLang's shared format can carry a meta tensor (shape, no data): once it failed at its own copy,
    # after the weights before it had changed, with the version left as it was
    from slime_async.weight_wire.shared_tensors import serialize_shared

    named = [("model.norm.weight", other.state_dict()["model.norm.weight"]),
             ("model.layers.0.input_layernorm.weight", torch.empty(256, device="meta"))]
    body = {"serialized_named_tensors": [serialize_shared(named)], "weight_version": "9"}
    status, out = await post(engine_url, "/update_weights_from_tensor", body)
    assert status == 400 and "'model.layers.0.input_layernorm.weight' holds no data here (meta" in out["message"]
    status, done = await post(engine_url, "/generate", greedy_body(PROMPTS[2], n=12))
    assert done["output_ids"] == hf_greedy(reference, PROMPTS[2], 12)  # model.norm.weight untouched
    assert done["meta_info"]["weight_version"] == "0"
