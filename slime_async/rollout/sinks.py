"""Where finished groups go: the trainer's buffer (the ZeroMQ sender), a JSONL file, or a list.

A sink takes whole groups: the scheduler hands one over only when all its samples finished, so
group-relative advantages (GRPO) can be computed from what arrives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from slime_async.types import Trajectory, to_json

if TYPE_CHECKING:
    from slime_async.transport import AsyncSender


class Sink(Protocol):
    async def put(self, group: list[Trajectory]) -> None:
        """Take one finished group; may wait (back-pressure), must not drop."""

    async def close(self) -> None:
        """Flush and release resources."""


class JsonlSink:
    """Appends each trajectory as one JSON line (`slime-async rollout --out FILE`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self.written = 0

    async def put(self, group: list[Trajectory]) -> None:
        data = b"".join(to_json(t) + b"\n" for t in group)
        await asyncio.to_thread(self._write, data)
        self.written += len(group)

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()

    async def close(self) -> None:
        self._file.close()


class BufferSink:
    """Groups to the buffer server over ZeroMQ: the transport's acked, credit-controlled sender.

    `put` waits for credits (back-pressure from the buffer, never a drop); `close` waits up to
    `flush_timeout` seconds for the buffer to acknowledge everything sent.
    """

    def __init__(self, sender: AsyncSender, flush_timeout: float = 60.0) -> None:
        self.sender = sender
        self.flush_timeout = flush_timeout

    async def put(self, group: list[Trajectory]) -> None:
        for trajectory in group:
            await self.sender.send(trajectory)

    async def close(self) -> None:
        await self.sender.flush(self.flush_timeout)


class ListSink:
    """Keeps groups in memory (tests, evaluation)."""

    def __init__(self) -> None:
        self.groups: list[list[Trajectory]] = []

    async def put(self, group: list[Trajectory]) -> None:
        self.groups.append(group)

    async def close(self) -> None:
        pass
