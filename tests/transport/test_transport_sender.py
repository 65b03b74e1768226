"""Senders: credit-based flow control (they wait, never drop), acks, resends after a restart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
from transport_helpers import make_trajectory, server_thread

from slime_async.buffer import BufferClient
from slime_async.transport import AsyncSender, SyncSender
from slime_async.transport import protocol as p
from slime_async.transport.sender_core import SenderCore


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_full_buffer_makes_senders_wait_and_nothing_is_dropped() -> None:
    capacity, credits, total = 8, 4, 40
    with server_thread(capacity=capacity, sender_credits=credits) as server:
        client = BufferClient(server.endpoint, retry_s=0.2)
        async with AsyncSender(server.endpoint) as sender:

            async def send_all() -> None:
                for k in range(total):
                    await sender.send(make_trajectory(k))

            task = asyncio.create_task(send_all())

            async def blocked() -> bool:
                m = await asyncio.to_thread(client.metrics)
                return m["ready"] >= capacity and not sender.core.can_enqueue() and sender.unacked == 0

            await _until(blocked, 10, "the sender to run out of credits")
            m = await asyncio.to_thread(client.metrics)
            assert not task.done() and m["received"] <= capacity + credits, m
            taken = 0
            while taken < total:  # the trainer takes batches; the room lets the sender go on
                batch = await asyncio.to_thread(client.get_batch, 1, 10.0)
                taken += batch.num_trajectories
                await asyncio.to_thread(lambda: client.set_version(0, committed=0))  # trained and checkpointed
            await asyncio.wait_for(task, 10)
            await sender.flush(10)
            m = await asyncio.to_thread(client.metrics)
            assert sender.stats.acked == total and (m["received"], m["trained"], m["buffered"]) == (total, total, 0)
        client.close()


def test_sync_sender_reconnects_when_the_server_falls_silent(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/b.sock"
    mute = zmq.Context.instance().socket(zmq.ROUTER)  # accepts connections, never answers
    mute.bind(endpoint)
    sender = SyncSender(endpoint, heartbeat_s=0.1, heartbeat_timeout_s=0.4)
    try:
        with pytest.raises(TimeoutError, match="a credit from the buffer"):
            sender.send(make_trajectory(0), timeout=1.0)  # no credit: it waits, then says so
        assert sender.stats.reconnects >= 1 and sender.unacked == 0  # not accepted, so not lost either
        mute.close(linger=0)
        with server_thread(endpoint=endpoint) as server:
            sender.send(make_trajectory(0), timeout=10)
            sender.flush(10)
            assert server.metrics()["received"] == 1 and sender.stats.acked == 1
    finally:
        sender.close()


def test_sender_core_requeues_unacked_items_in_a_new_session() -> None:
    core = SenderCore("w", heartbeat_s=1, heartbeat_timeout_s=5, batch_items=1)
    core.new_session(0.0)
    for k in range(4):
        core.enqueue(f"t{k}", b"frame")
    assert core.next_data() is None  # no credit yet
    core.on_message([p.GRANT, p.pack_u64(1), p.pack_u64(3)], 0.1)
    sent = [core.next_data() for _ in range(4)]
    assert [m is not None for m in sent] == [True, True, True, False]  # three credits, three sends
    core.on_message([p.ACK, p.encode(p.Ack(seqs=[0]))], 0.2)
    core.on_message([p.GRANT, p.pack_u64(0), p.pack_u64(99)], 0.2)  # a grant of an old session: ignored
    assert core.credit() == 0
    hello = core.on_message([p.RESET, p.pack_u64(1)], 0.3)  # the server forgot us
    assert hello is not None and hello[0] == p.HELLO and core.session == 2
    assert list(core.queue) == [1, 2, 3] and core.stats.resent == 2  # seq 3 was never sent
    assert core.on_message([p.RESET, p.pack_u64(1)], 0.3) is None  # a late RESET of the old session
    core.on_message([p.GRANT, p.pack_u64(2), p.pack_u64(10)], 0.4)
    frames = [core.next_data() for _ in range(3)]
    assert [p.unpack_u64(f[2], "seq") for f in frames] == [1, 2, 3]
    core.on_message([p.ACK, p.encode(p.Ack(seqs=[1, 2]))], 0.5)
    core.on_message([p.NACK, p.pack_u64(3), b"invalid: bad"], 0.5)
    assert core.all_acked() and core.stats.acked == 3 and core.stats.nacked_by_reason == {"invalid": 1}
    assert core.server_dead(0.5 + 5.1) and not core.server_dead(0.5 + 4.9)


def test_sender_core_batches_items_within_credits_count_and_bytes() -> None:
    core = SenderCore("w", batch_items=4, batch_bytes=250)
    core.new_session(0.0)
    for k in range(10):
        core.enqueue(f"t{k}", bytes([k]) * 100)
    core.on_message([p.GRANT, p.pack_u64(1), p.pack_u64(7)], 0.1)
    msgs = []
    while (msg := core.next_data()) is not None:
        msgs.append(msg)
    # 250 bytes fit two 100-byte frames; seven credits: 2 + 2 + 2 + 1 items, frames in seq order
    assert [p.unpack_seqs(m[2], len(m) - 3) for m in msgs] == [[0, 1], [2, 3], [4, 5], [6]]
    assert all(m[3 + i] == bytes([s]) * 100 for m in msgs for i, s in enumerate(p.unpack_seqs(m[2], len(m) - 3)))
    assert core.credit() == 0 and core.stats.sent == 7
    core.not_sent(msgs[-1])  # the socket refused the last message: its item goes back, first in line
    core.not_sent(msgs[-2])
    assert list(core.queue)[:4] == [4, 5, 6, 7] and core.credit() == 3 and core.stats.sent == 4
    core.on_message([p.ACK, p.encode(p.Ack(seqs=[4]))], 0.2)  # acked while queued: skipped, not sent
    assert p.unpack_seqs(core.next_data()[2], 2) == [5, 6]


def test_large_frames_cross_without_a_copy_and_arrive_read_only() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://zero-copy")
        b.connect("inproc://zero-copy")
        p.zero_copy_sends(a)
        assert a.copy_threshold == p.ZERO_COPY_BYTES
        big = b"x" * p.ZERO_COPY_BYTES
        a.send_multipart([p.DATA, big], copy=False)
        small, large = p.recv_frames(b)
        assert small == p.DATA and isinstance(small, bytes)
        assert isinstance(large, memoryview) and large.readonly and large == big
        with pytest.raises(TypeError):
            large[0] = 0  # the buffer keeps received frames unchanged: trajectories decode as views of them
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_sender_and_server_sockets_send_large_frames_without_a_copy() -> None:
    with server_thread() as server, SyncSender(server.endpoint) as sender:
        assert sender._sock is not None and sender._sock.copy_threshold == p.ZERO_COPY_BYTES
        assert server.sock.copy_threshold == p.ZERO_COPY_BYTES
        sent = make_trajectory(tokens=8192)  # ~65 kB: travels zero-copy both hops
        sender.send(sent)
        sender.flush(10)
        with BufferClient(server.endpoint, retry_s=0.2) as client:
            got = client.get_batch(1, timeout=5).groups[0].trajectories[0]
        assert got.id == sent.id and (got.turns[0].completion_ids == sent.turns[0].completion_ids).all()
