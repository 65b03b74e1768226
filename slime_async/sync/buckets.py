"""Splitting named tensors into buckets of at most a byte limit, in order."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_named_tensors(named: Iterable[tuple[str, torch.Tensor]], limit_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive buckets whose payload stays within `limit_bytes`; a larger tensor goes alone.

    Order is kept, so that every engine receives the same buckets in the same order.
    """
    if limit_bytes <= 0:
        raise ValueError(f"sync.bucket_mb: the bucket limit must be positive, got {limit_bytes} bytes")
    buckets: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        if name in current or any(name in b for b in buckets):
            raise ValueError(f"weight {name!r} appears twice")
        n = tensor_bytes(t)
        if current and size + n > limit_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    if current:
        buckets.append(current)
    return buckets
