"""Engines sharing the trainer's GPUs: memory released around training steps and taken back.

Against a real engine process: SGLang's preconditions (an idle or retract-paused engine), nothing
generated while released, the same output after a resume, and the publisher's release/restore
pair bringing the engine back on the new version with generation resumed.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

from engine_helpers import PROMPT, engine_greedy, get, hf_greedy, perturbed, post
from transformers import AutoModelForCausalLM

from slime_async.config.schema import SyncConfig
from slime_async.sync import WeightPublisher


def state(info: dict) -> dict:
    return info["internal_states"][0]


async def test_release_needs_an_idle_engine_blocks_generation_and_resume_restores_it(engine, varied_dir: Path) -> None:
    url = engine.url
    before, _ = await engine_greedy(url, PROMPT)
    long_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "temperature": 0.0,
                                                          "ignore_eos": True}}
    running = asyncio.ensure_future(post(url, "/generate", long_body))
    for _ in range(500):  # bounded wait until it decodes
        if state(await get(url, "/get_server_info"))["num_running_reqs"]:
            break
        await asyncio.sleep(0.01)
    status, out = await post(url, "/release_memory_occupation", {})
    assert status == 400 and "idle" in out["error"]["message"]  # SGLang's rule: idle, or paused first
    assert (await post(url, "/pause_generation", {"mode": "retract"}))[0] == 200
    assert (await post(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}))[0] == 200
    info = state(await get(url, "/get_server_info"))
    assert info["memory_released"] == ["kv_cache", "weights"] and info["num_running_reqs"] == 0
    assert (await post(url, "/continue_generation", {}))[0] == 200
    tokens = info["generated_tokens"]
    await asyncio.sleep(0.3)  # released: nothing may run, even unpaused (a real condition is absence)
    assert state(await get(url, "/get_server_info"))["generated_tokens"] == tokens and not running.done()
    assert (await post(url, "/resume_memory_occupation", {}))[0] == 200
    status, out = await asyncio.wait_for(running, 60)  # the retracted request finishes after the resume
    assert status == 200 and len(out["output_ids"]) == 400
    assert state(await get(url, "/get_server_info"))["memory_released"] == []
    assert (await engine_greedy(url, PROMPT))[0] == before  # the weights came back unchanged
    status, out = await post(url, "/release_memory_occupation", {"tags": ["gpu_everything"]})
    assert status == 400 and "tags" in out["error"]["message"]


async def test_publisher_releases_then_restores_with_the_new_version(engine, varied_dir: Path) -> None:
    other = perturbed(copy.deepcopy(AutoModelForCausalLM.from_pretrained(varied_dir).eval()), seed=3)
    expected = hf_greedy(other, PROMPT)
    async with WeightPublisher([engine.url], SyncConfig(retry_backoff_s=0.0)) as publisher:
        assert await publisher.release_memory() == [engine.url]
        info = state(await get(engine.url, "/get_server_info"))
        assert info["paused"] and info["memory_released"] == ["kv_cache", "weights"]
        report = await publisher.restore_memory(lambda: ((n, p.detach()) for n, p in other.named_parameters()), 7)
        assert report.updated == [engine.url] and not report.failed
    info = state(await get(engine.url, "/get_server_info"))
    assert not info["paused"] and info["memory_released"] == []
    ids, version = await engine_greedy(engine.url, PROMPT)
    assert (ids, version) == (expected, "7")
