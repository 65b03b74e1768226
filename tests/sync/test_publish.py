"""Weight publishing to a real engine process over HTTP: tensor and disk modes, missed updates,
retries, all-or-nothing pushes, and the NCCL endpoints' refusal by the embedded engine."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import aiohttp
import pytest
import torch
from engine_helpers import PROMPT, engine_greedy, get, hf_greedy, perturbed
from helpers import wait_for_tokens
from transformers import AutoModelForCausalLM

from slime_async.config.schema import SyncConfig
from slime_async.rollout.client import SGLangClient
from slime_async.sync import WeightPublisher
from slime_async.sync.buckets import bucket_named_tensors
from slime_async.sync.disk import prune_versions, write_version


@pytest.fixture(scope="module")
def base(varied_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(varied_dir).eval()


@pytest.fixture(scope="module")
def other(base: torch.nn.Module) -> torch.nn.Module:
    return perturbed(copy.deepcopy(base), seed=1)


def weights_of(model: torch.nn.Module):  # -> NamedWeights
    return lambda: ((n, p.detach()) for n, p in model.named_parameters())


def fast(**kw: object) -> SyncConfig:
    return SyncConfig(**{"retry_backoff_s": 0.0, "timeout_s": 60.0, **kw})  # type: ignore[arg-type]


def test_buckets_respect_the_limit_and_order() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(20)), ("c", torch.zeros(100)), ("d", torch.zeros(5))]
    buckets = bucket_named_tensors(named, limit_bytes=120)  # float32: 40, 80, 400, 20 bytes
    assert [list(b) for b in buckets] == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(ValueError, match="bucket"):
        bucket_named_tensors(named, 0)
    with pytest.raises(ValueError, match="twice"):
        bucket_named_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100)


def test_disk_writes_whole_versions_and_prunes(tmp_path: Path) -> None:
    for v in range(4):
        write_version(tmp_path, v, [("w", torch.full((3,), float(v)))])
    write_version(tmp_path, 3, [("w", torch.full((3,), 9.0))])  # rewritten whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0", "v1", "v2", "v3"]  # no temporaries left
    prune_versions(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "v3" / "model.safetensors"))["w"].tolist() == [9.0] * 3


async def test_tensor_mode_in_buckets_changes_output_exactly(engine, base, other) -> None:
    before, after = hf_greedy(base, PROMPT), hf_greedy(other, PROMPT)
    assert before != after
    async with WeightPublisher([engine.url], fast(mode="tensor", bucket_mb=0.5)) as pub:
        report = await pub.publish(weights_of(other), 1)
        assert report.updated == [engine.url] and not report.failed and report.buckets > 1
        assert await engine_greedy(engine.url, PROMPT) == (after, "1")
        assert (await pub.engine_versions()) == {engine.url: 1}
        info = await get(engine.url, "/get_server_info")
        assert info["internal_states"][0]["paused"] is False  # resumed after the bucketed push
        report = await pub.publish(weights_of(base), 2)
        assert await engine_greedy(engine.url, PROMPT) == (before, "2")


@pytest.mark.parametrize("partial_mode", ["in_place", "abort"])
async def test_a_request_spanning_a_push_goes_on_in_place_or_is_aborted_and_resumed(
        engine, base, other, partial_mode: str) -> None:  # fmt: skip
    # rollout.partial_mode: in place, the request keeps its KV cache (old weights) and decodes on; abort,
    # it ends with its partial output and the client resends that as the prompt of its rest, prefilled
    # under the new weights
    ids = PROMPT
    async with SGLangClient([engine.url]) as client, WeightPublisher(
            [engine.url], fast(), partial_mode=partial_mode) as pub:  # type: ignore[arg-type]
        call = asyncio.ensure_future(client.generate(ids, {"max_new_tokens": 200, "temperature": 0.0,
                                                           "ignore_eos": True}))
        await wait_for_tokens(engine.url)
        report = await pub.publish(weights_of(other), 7)
        gen = await asyncio.wait_for(call, 120)
        await pub.publish(weights_of(base), 8)
    assert not report.failed and report.updated == [engine.url]
    # aborted, nothing runs while the engine is paused: its cached prefixes are dropped before it resumes
    # (the engine refuses a flush while a request runs, as SGLang's does)
    assert report.flushed == ([engine.url] if partial_mode == "abort" else [])
    tokens, versions = gen.output_ids.tolist(), gen.versions.tolist()
    k = versions.index(7)
    assert 0 < k < 200 and len(set(versions[:k])) == 1 and set(versions[k:]) == {7} and len(tokens) == 200
    assert tokens[:k] == hf_greedy(base, ids, k)
    assert gen.resumed == (partial_mode == "abort")
    if partial_mode == "abort":  # the rest is the new model's greedy continuation of prompt + partial output
        assert tokens[k:] == hf_greedy(other, ids + tokens[:k], 200 - k)


async def test_disk_mode(engine, base, other, tmp_path: Path) -> None:
    async with WeightPublisher([engine.url], fast(mode="disk", keep_disk_versions=1), disk_dir=tmp_path) as pub:
        report = await pub.publish(weights_of(other), 3)
        assert not report.failed, report.failed
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(other, PROMPT), "3")
        await pub.publish(weights_of(base), 4)
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(base, PROMPT), "4")
        assert [p.name for p in tmp_path.iterdir()] == ["v4"]


async def test_engine_that_missed_an_update_is_detected_and_brought_up_to_date(engine, base, other) -> None:
    async with WeightPublisher([engine.url], fast()) as pub:
        await pub.publish(weights_of(other), 5)
        # the engine restarts with its initial weights: it reports version 0 again
        async with WeightPublisher([engine.url], fast()) as restart:
            await restart.publish(weights_of(base), 0)
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(base, PROMPT), "0")
        assert await pub.reconcile(weights_of(other), 5) == [engine.url]
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(other, PROMPT), "5")
        assert await pub.reconcile(weights_of(other), 5) == []  # nothing behind: nothing sent
        # the same detection happens at the next publish, and is reported
        async with WeightPublisher([engine.url], fast()) as restart:
            await restart.publish(weights_of(base), 0)
        report = await pub.publish(weights_of(other), 6)
        assert report.missed == [engine.url] and report.updated == [engine.url]


async def test_a_starting_trainer_resumes_an_engine_left_paused_on_the_current_version(engine, base) -> None:
    """A trainer killed between a push's last update and its /continue_generation leaves the engine
    paused on the current version (not behind): the next trainer's first reconcile resumes it."""
    async with WeightPublisher([engine.url], fast()) as pub:
        await pub.publish(weights_of(base), 3)
        async with aiohttp.ClientSession() as s, s.post(engine.url + "/pause_generation",
                                                        json={"mode": "in_place"}) as r:
            assert r.status == 200  # the dead trainer's pause
        assert (await get(engine.url, "/get_server_info"))["internal_states"][0]["paused"]
    async with WeightPublisher([engine.url], fast()) as restarted:
        assert await restarted.reconcile(weights_of(base), 3) == []  # not behind
        assert not (await get(engine.url, "/get_server_info"))["internal_states"][0]["paused"]
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(base, PROMPT), "3")


async def test_failed_push_is_retried_and_never_half_applied(engine, base, other) -> None:
    async with WeightPublisher([engine.url], fast(bucket_mb=0.5)) as pub:
        await pub.publish(weights_of(base), 7)

        def broken() -> Iterable[tuple[str, torch.Tensor]]:
            # a real first part, then a tensor the engine refuses: the last bucket fails every time
            yield from ((n, p.detach()) for n, p in other.named_parameters())
            yield "model.no_such_weight", torch.zeros(3)

        report = await pub.publish(broken, 8)
        assert list(report.failed) == [engine.url] and "no_such_weight" in report.failed[engine.url]
        assert report.attempts == 4  # 1 + sync.retries
        info = await get(engine.url, "/get_server_info")
        # paused, so that the half of the weights already copied never serves; still on version 7
        assert info["internal_states"][0]["paused"] is True
        assert (await pub.engine_versions()) == {engine.url: 7}
        pub.cfg = fast(bucket_mb=512)  # one bucket: no pause of its own, yet it must resume the engine
        report = await pub.publish(weights_of(other), 8)
        assert not report.failed and report.buckets == 1
        assert (await get(engine.url, "/get_server_info"))["internal_states"][0]["paused"] is False
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(other, PROMPT), "8")


async def test_unreachable_engine_fails_with_its_url_after_retries() -> None:
    url = "http://127.0.0.1:9"  # discard port: connection refused
    async with WeightPublisher([url], fast(retries=1)) as pub:
        report = await pub.publish(lambda: [("w", torch.zeros(2))], 1)
    assert report.attempts == 2 and url in report.failed[url]
    assert pub.published is None


async def test_nccl_mode_is_refused_by_the_embedded_engine_clearly(engine) -> None:
    async with WeightPublisher([engine.url], fast(mode="nccl", timeout_s=30.0)) as pub:
        report = await pub.publish(lambda: [("model.norm.weight", torch.ones(256))], 9)
    assert report.attempts == 1  # 501 is not retried
    assert "501" in report.failed[engine.url] and "not supported by the embedded engine" in report.failed[engine.url]
    # the trainer's side of the rendezvous ended with the refusal, not at its timeout: a thread
    # still waiting inside torch when the process exits aborts it
    assert not [t for t in threading.enumerate() if t.name == "weight-update-group"]


def test_bad_setup_is_named() -> None:
    with pytest.raises(ValueError, match="no engine URLs"):
        WeightPublisher([], SyncConfig())
    with pytest.raises(ValueError, match="disk_dir"):
        WeightPublisher(["http://x"], SyncConfig(mode="disk"))


async def test_shared_tensors_reach_the_engine_as_handles_and_change_output_exactly(engine, base, other) -> None:
    # SGLang's own format (pickled handles; shared memory on CPU, CUDA IPC on a GPU): one request
    # whatever the size, and nothing of the weights inside it
    async with WeightPublisher([engine.url], fast(mode="tensor", tensor_format="shared", bucket_mb=0.5)) as pub:
        report = await pub.publish(weights_of(other), 10)
        assert report.updated == [engine.url] and not report.failed and report.buckets == 1
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(other, PROMPT), "10")
        report = await pub.publish(weights_of(base), 11)
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(base, PROMPT), "11")
        assert not pub._no_shared


def test_shared_tensor_items_are_small_and_refuse_foreign_code() -> None:
    import base64
    import pickle

    from slime_async.weight_wire.codec import decode_named_tensors
    from slime_async.weight_wire.shared_tensors import deserialize_shared, serialize_shared

    big = torch.randn(256, 1024)
    item = serialize_shared([("w", big)])
    assert len(item) < 4096 < big.numel() * 4  # a handle, not the bytes
    assert torch.equal(decode_named_tensors([item])["w"], big)

    class Evil:
        def __reduce__(self):  # what a malicious item would carry: a call of any global
            return (print, ("owned",))

    evil = pickle.dumps([("w", Evil())], protocol=5)
    with pytest.raises(ValueError, match=r"serialized_named_tensors\[0\]: global builtins.print is not allowed"):
        deserialize_shared(evil, 0, 2**30)
    with pytest.raises(ValueError, match=r"serialized_named_tensors\[0\].*list of \(name, tensor\)"):
        decode_named_tensors([base64.b64encode(pickle.dumps({"w": 1}, protocol=5)).decode()])


async def test_engine_that_cannot_open_the_handles_gets_safetensors(engine, base, other, monkeypatch) -> None:
    # an engine on another host answers that it cannot open them: that engine gets the bytes instead
    import base64

    import slime_async.sync.tensor as publisher  # tensor mode's module serialises the handles

    real = publisher.serialize_shared

    def unreachable_handles(named):  # handles that name shared-memory files this host does not have
        raw = base64.b64decode(real(named))
        assert b"/torch_" in raw  # the same length (a pickle's byte strings carry theirs): another number
        return base64.b64encode(re.sub(rb"(/torch_\d+_)(\d+)", lambda m: m[1] + b"7" * len(m[2]), raw)).decode()

    monkeypatch.setattr(publisher, "serialize_shared", unreachable_handles)
    async with WeightPublisher([engine.url], fast(mode="tensor", tensor_format="shared")) as pub:
        report = await pub.publish(weights_of(other), 12)
        assert report.updated == [engine.url] and not report.failed
        assert pub._no_shared == {engine.url}
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(other, PROMPT), "12")
