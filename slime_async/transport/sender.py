"""Trajectory senders: how a rollout worker hands finished trajectories to the buffer.

`AsyncSender` is for asyncio code (the rollout scheduler): `await sender.send(trajectory)` returns
once the item is queued, waiting while the buffer grants no credit (it never drops); the items
queued until the caller next yields to the event loop leave together, up to `batch_items` per
ZeroMQ message. A background task reads acks and grants, pings the server and reconnects when it
falls silent.
`SyncSender` is the same protocol for plain code, driven by the caller's own calls (no thread).
Both keep every item until the buffer acks it, so a restart of either side loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from slime_async.transport import protocol as p
from slime_async.transport.security import secure_client
from slime_async.transport.sender_core import AckCallback, NackCallback, SenderCore, SenderStats
from slime_async.types import Trajectory, to_msgpack

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20


class _SenderBase:
    def __init__(
        self,
        endpoint: str,
        *,
        curve_dir: str | Path | None = None,
        name: str | None = None,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_ack: AckCallback | None = None,
        on_nack: NackCallback | None = None,
        batch_items: int = 32,
        batch_bytes: int = 4 * 2**20,
    ) -> None:
        self.endpoint = endpoint
        self.curve_dir = curve_dir
        self.max_frame_bytes = max_frame_bytes
        self.core = SenderCore(
            name, heartbeat_s, heartbeat_timeout_s, on_ack, on_nack, batch_items=batch_items, batch_bytes=batch_bytes
        )
        self._closed = False

    @property
    def stats(self) -> SenderStats:
        return self.core.stats

    @property
    def unacked(self) -> int:
        return len(self.core.unacked)

    def _encode(self, trajectory: Trajectory) -> bytes:
        frame = to_msgpack(trajectory)
        if len(frame) > self.max_frame_bytes:
            # The server would reject it anyway; failing here names the trajectory and the fix.
            raise ValueError(
                f"trajectory {trajectory.id}: frame of {len(frame):,} bytes exceeds max_frame_bytes="
                f"{self.max_frame_bytes:,} (buffer.max_frame_bytes); raise the limit or shorten episodes"
            )
        return frame

    def _setup_socket(self, sock: zmq.Socket) -> None:
        secure_client(sock, self.endpoint, self.curve_dir)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what is in flight; never block or drop in zmq
        sock.setsockopt(zmq.RCVHWM, 0)
        p.zero_copy_sends(sock)  # trajectory frames leave from the bytes that `unacked` keeps anyway
        # A fresh routing id per socket: the server sees a reconnect as a new session.
        sock.setsockopt(zmq.ROUTING_ID, b"s" + os.urandom(8))
        sock.connect(self.endpoint)


class AsyncSender(_SenderBase):
    """Sends trajectories from an asyncio event loop. Use as `async with AsyncSender(...) as s:`."""

    def __init__(self, endpoint: str, *, context: zmq.asyncio.Context | None = None, **kwargs: Any) -> None:
        super().__init__(endpoint, **kwargs)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._pump_soon: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        await self._open()
        self._task = asyncio.create_task(self._run(), name=f"sender {self.core.name}")

    async def __aenter__(self) -> AsyncSender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, trajectory: Trajectory) -> None:
        """Queue `trajectory` for the buffer, waiting for a credit; it is resent until acked."""
        if self._task is None or self._changed is None:
            raise RuntimeError("AsyncSender.send before start(): use `async with AsyncSender(...)`")
        frame = self._encode(trajectory)
        async with self._changed:
            await self._changed.wait_for(lambda: self.core.can_enqueue() or self._task.done())
        self._raise_if_dead()
        self.core.enqueue(trajectory.id, frame)
        if len(self.core.queue) >= self.core.batch_items:
            await self._pump()
        elif self._pump_soon is None or self._pump_soon.done():
            # Transmit when the caller next yields: what it queues until then leaves in one message.
            self._pump_soon = asyncio.create_task(self._pump())

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every item sent so far is acked or nacked (TimeoutError after `timeout`)."""
        if self._changed is None:
            return
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: self.core.all_acked() or self._task.done()), timeout
            )
        self._raise_if_dead()

    async def close(self, flush_timeout: float | None = 0.0) -> None:
        """Stop; with `flush_timeout` > 0, first wait that long for outstanding acks."""
        if flush_timeout:
            with contextlib.suppress(TimeoutError):
                await self.flush(flush_timeout)
        self._closed = True
        if self._pump_soon is not None:
            self._pump_soon.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)

    def _raise_if_dead(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            exc = self._task.exception()
            if exc is not None:
                raise RuntimeError(f"sender {self.core.name}: background task failed: {exc!r}") from exc

    async def _open(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._setup_socket(self._sock)
        await self._send(self.core.new_session(time.monotonic()))

    async def _send(self, msg: list[bytes]) -> bool:
        # Never block on the socket: with no connected peer (server down, handshake refused) zmq
        # would wait forever. A refused control message is simply sent again by the protocol later.
        assert self._sock is not None
        try:
            await self._sock.send_multipart(msg, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def _pump(self) -> None:
        while (msg := self.core.next_data()) is not None:
            if not await self._send(msg):
                self.core.not_sent(msg)
                return

    async def _run(self) -> None:
        assert self._changed is not None
        while not self._closed:
            sock = self._sock
            assert sock is not None
            now = time.monotonic()
            if await sock.poll(max(1, int(self.core.next_timer(now) * 1000)), zmq.POLLIN):
                while True:
                    try:
                        frames = await sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self.core.on_message(frames, time.monotonic())
                    if reply is not None:
                        await self._send(reply)
            now = time.monotonic()
            if self.core.server_dead(now):
                self.core.stats.reconnects += 1
                await self._open()
            elif self.core.ping_due(now):
                await self._send(self.core.ping())
            await self._pump()
            async with self._changed:
                self._changed.notify_all()


class SyncSender(_SenderBase):
    """Sends trajectories from plain (non-async) code. Use as `with SyncSender(...) as s:`.

    It has no thread: it reads acks, pings and reconnects inside `send`, `flush` and `poll`; call
    `poll()` now and then when idle for long (an idle sender the server forgot just says HELLO again).
    """

    def __init__(self, endpoint: str, *, context: zmq.Context | None = None, **kwargs: Any) -> None:
        super().__init__(endpoint, **kwargs)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._open()

    def __enter__(self) -> SyncSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, trajectory: Trajectory, timeout: float | None = None) -> None:
        """Queue `trajectory`, waiting (up to `timeout`, else forever) for a credit; it leaves at once
        (with any resends queued before it), since there is no background task to send it later."""
        frame = self._encode(trajectory)
        self._wait(self.core.can_enqueue, timeout, "a credit from the buffer (is it full, or down?)")
        self.core.enqueue(trajectory.id, frame)
        self._pump()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every item sent so far is acked or nacked."""
        self._wait(self.core.all_acked, timeout, "acks for every sent trajectory")

    def poll(self, timeout: float = 0.0) -> None:
        """Process whatever the server sent, and heartbeats, for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        self._step(timeout)
        while time.monotonic() < deadline:
            self._step(deadline - time.monotonic())

    def close(self, flush_timeout: float = 0.0) -> None:
        if flush_timeout and not self._closed:
            with contextlib.suppress(TimeoutError):
                self.flush(flush_timeout)
        self._closed = True
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _wait(self, predicate: Any, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"sender {self.core.name}: {what} did not come within {timeout} s ({self.endpoint})")
            self._step(left)

    def _open(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._setup_socket(self._sock)
        self._send(self.core.new_session(time.monotonic()))

    def _send(self, msg: list[bytes]) -> bool:
        assert self._sock is not None
        try:  # never block: see AsyncSender._send
            self._sock.send_multipart(msg, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _pump(self) -> None:
        while (msg := self.core.next_data()) is not None:
            if not self._send(msg):
                self.core.not_sent(msg)
                return

    def _step(self, max_wait: float | None) -> None:
        sock = self._sock
        assert sock is not None, "sender is closed"
        now = time.monotonic()
        wait = self.core.next_timer(now) if max_wait is None else min(max_wait, self.core.next_timer(now))
        if sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = self.core.on_message(frames, time.monotonic())
                if reply is not None:
                    self._send(reply)
        now = time.monotonic()
        if self.core.server_dead(now):
            self.core.stats.reconnects += 1
            self._open()
        elif self.core.ping_due(now):
            self._send(self.core.ping())
        self._pump()
