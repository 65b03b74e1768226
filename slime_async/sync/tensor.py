"""Tensor mode: weights in the body of `/update_weights_from_tensor`, serialised once for every engine.

Two payloads (`sync.tensor_format`): SGLang's own tensor handles (`shared`: CUDA IPC, or shared
memory for CPU tensors; one small request, no bytes copied through HTTP), or safetensors files in
base64, bucketed to `sync.bucket_mb` (any host). An engine that answers that it cannot open the
handles (another host or GPU) gets safetensors from then on (`no_shared`, kept by the publisher).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import torch

from slime_async.sync.buckets import bucket_named_tensors
from slime_async.sync.push import Engines, NamedWeights, Prepared, PushError
from slime_async.weight_wire.codec import safetensors_bytes
from slime_async.weight_wire.shared_tensors import serialize_shared

log = logging.getLogger(__name__)


async def prepare_tensor(pub: Engines, weights: NamedWeights, version: int, limit: int,
                         no_shared: set[str]) -> Prepared:
    """Serialise `weights()` once (handles or safetensors buckets of at most `limit` bytes); returns the
    per-engine push, the bytes and the number of requests."""
    def encode() -> tuple[list[bytes], int, int, Any]:
        named = list(weights())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        if shared_format(pub.cfg.tensor_format, named):
            if any(t.is_cuda for _, t in named):
                torch.cuda.synchronize()  # the optimizer's last kernels must have written the weights
            # handles are a few bytes each: one request, so no pause is needed around it
            bodies = [tensor_body([serialize_shared(named)] * pub.engine_tp_size, version, last=True)]
            return bodies, nbytes, 1, lambda: safetensors_bodies(named, limit, version)
        bodies = safetensors_bodies(named, limit, version)
        return bodies, nbytes, len(bodies), None

    payloads, nbytes, nbuckets, fallback = await asyncio.to_thread(encode)
    copies: list[list[bytes]] = []

    async def push_tensor(url: str) -> None:
        if fallback is not None and url in no_shared:
            if not copies:  # made once, for every engine that cannot open the handles
                copies.append(await asyncio.to_thread(fallback))
            await push_bodies(pub, url, copies[0])
            return
        try:
            await push_bodies(pub, url, payloads)
        except PushError as exc:
            if fallback is None or "cannot open shared tensors" not in str(exc):
                raise
            # another host or GPU: the engine cannot map our memory; send bytes from now on
            log.warning("%s cannot open shared tensors; sending it safetensors instead: %s", url, exc)
            no_shared.add(url)
            await push_tensor(url)

    return push_tensor, nbytes, nbuckets


def shared_format(tensor_format: str, named: list[tuple[str, torch.Tensor]]) -> bool:
    return tensor_format == "shared" or (tensor_format == "auto" and any(t.is_cuda for _, t in named))


async def push_bodies(pub: Engines, url: str, bodies: list[bytes]) -> None:
    await pub.pause(url)
    for body in bodies:
        await pub.post(url, "/update_weights_from_tensor", body)


def tensor_body(items: list[str] | list[bytes], version: int, last: bool) -> bytes:
    """One `/update_weights_from_tensor` request body (the version on the last; no cache flush: the
    engine is paused in place with requests running, see `sync.publisher`'s docstring)."""
    body: dict[str, Any] = {"serialized_named_tensors": items, "flush_cache": False}
    if last:
        body["weight_version"] = str(version)
    return msgspec.json.encode(body)


def safetensors_bodies(named: list[tuple[str, torch.Tensor]], limit: int, version: int) -> list[bytes]:
    """The weights as safetensors files of at most `limit` bytes (a larger tensor goes alone), one
    request body each, shared by every engine."""
    buckets = bucket_named_tensors(named, limit)
    return [tensor_body([safetensors_bytes(b)], version, last=i == len(buckets) - 1) for i, b in enumerate(buckets)]
