"""The NCCL weight path's protocol, over gloo on CPU, against a receiver process speaking SGLang's
request bodies (`gloo_receiver.py`). NCCL itself and real SGLang are not exercised here."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import get

from slime_async.config.schema import SyncConfig
from slime_async.sync import WeightPublisher


@pytest.fixture
def receiver() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gloo_receiver.py"))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url: list[str] = []
    found = threading.Event()
    log: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if (m := re.search(r"serving on (http://\S+)", line)) and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(60) or not url:
        proc.kill()
        raise RuntimeError("receiver did not start:\n" + "".join(log))
    yield url[0]
    proc.terminate()
    proc.wait(timeout=20)


async def test_weights_arrive_by_broadcast_with_the_version(receiver: str) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g),
               "c.weight": torch.randn(2, 2, generator=g).to(torch.bfloat16)}
    cfg = SyncConfig(mode="nccl", bucket_mb=48 / 2**20, timeout_s=60.0)  # 48 bytes: a.weight alone, then b + c
    async with WeightPublisher([receiver], cfg) as pub:
        report = await pub.publish(lambda: weights.items(), 1)
        assert not report.failed, report.failed
        assert report.buckets == 2 and report.updated == [receiver]
        got = await get(receiver, "/received")
        # paused around the whole push (an unpaused SGLang would wait for its running requests), aborting
        # what runs (SGLang's default partial mode), so that its cache is flushed before it resumes; the
        # updates ask for no flush of their own (SGLang refuses one while requests run)
        assert got["calls"] == ["pause abort", "update flush=False", "update flush=False", "flush", "continue"]
        got = got["tensors"]
        for name, t in weights.items():
            assert got[name]["dtype"] == str(t.dtype).removeprefix("torch.")
            assert got[name]["shape"] == list(t.shape)
            assert got[name]["values"] == t.float().flatten().tolist()
        assert (await pub.engine_versions()) == {receiver: 1}
        # the group is formed once; later publishes reuse it
        weights["b.bias"] = weights["b.bias"] + 1
        assert not (await pub.publish(lambda: weights.items(), 2)).failed
        got = (await get(receiver, "/received"))["tensors"]
        assert got["b.bias"]["values"] == weights["b.bias"].tolist()
        assert (await pub.engine_versions()) == {receiver: 2}
