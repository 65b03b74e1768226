"""What the publisher (`publisher`) and its three push modes (`tensor`, `disk`, `nccl`) share.

A mode serialises the weights once (`prepare_*`) and returns a `Prepared`: the push of one engine,
which the publisher runs for every engine with its retries, pause bookkeeping and version checks.
A mode sees the publisher only through `Engines`, its public surface.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import torch

from slime_async.config.engine_kinds import EngineKind
from slime_async.config.schema import SyncConfig

NamedWeights = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""Called once per publish: yields (HF name, tensor) for every parameter (`TrainerBackend.named_weights`)."""

Prepared = tuple[Callable[[str], Awaitable[None]], int, int]
"""(the push of one engine given its URL, bytes serialised, requests or buckets per engine)."""


class PushError(RuntimeError):
    """An engine refused or failed a weight update; the message names the engine and the endpoint."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable
        """False when retrying cannot help (the engine does not implement the endpoint: HTTP 501)."""


class Engines(Protocol):
    """The publisher as a push mode sees it (`WeightPublisher`)."""

    urls: list[str]
    cfg: SyncConfig
    kind: EngineKind
    engine_tp_size: int

    async def post(self, url: str, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]: ...

    async def pause(self, url: str) -> None: ...
