"""Bad input on the wire: each kind is rejected with its reason, counted, told to the sender, survived."""

from __future__ import annotations

import re

import msgspec
import numpy as np
import pytest
import zmq
from transport_helpers import RawPeer, make_trajectory, server_thread

from slime_async.buffer import BufferClient
from slime_async.buffer.server import max_frame_limit
from slime_async.transport import AsyncSender, Rejected, RejectReason, decode_trajectory
from slime_async.transport import protocol as p
from slime_async.types import to_msgpack


def _inconsistent_frame() -> bytes:
    raw = msgspec.msgpack.decode(to_msgpack(make_trajectory(1, tokens=8)))
    raw["turns"][0]["logprobs"] = msgspec.msgpack.Ext(2, np.zeros(5, "<f4").tobytes())  # 5 logprobs, 8 tokens
    return msgspec.msgpack.encode(raw)


def _bad_frames() -> dict[str, bytes]:
    good = to_msgpack(make_trajectory(0))
    return {
        "garbage": b"\xc1\xc1 not msgpack at all",
        "truncated": good[: len(good) // 2],
        "schema_version": to_msgpack(msgspec.structs.replace(make_trajectory(2), schema_version=99)),
        "oversized": to_msgpack(make_trajectory(3, tokens=4096)),
        "invalid": _inconsistent_frame(),
    }


def test_decoder_names_each_reason() -> None:
    for reason, frame in _bad_frames().items():
        with pytest.raises(Rejected) as info:
            decode_trajectory(frame, max_bytes=20_000)
        assert info.value.reason == RejectReason(reason), (reason, info.value)
    with pytest.raises(Rejected, match=r"at `\$.turns\[0\]`"):
        decode_trajectory(_inconsistent_frame(), max_bytes=20_000)  # the error names the place


def test_server_rejects_counts_tells_and_keeps_running() -> None:
    with server_thread(max_frame_bytes=20_000) as server:
        peer = RawPeer(server.endpoint)
        try:
            sent = {}
            for reason, frame in _bad_frames().items():
                sent[peer.send_data(frame)] = reason
            good = peer.send_data(to_msgpack(make_trajectory(7)))
            answers = peer.answers(len(sent) + 1)
            for seq, reason in sent.items():
                kind, why = answers[seq]
                assert kind == "nack" and why.startswith(reason + ":"), (reason, answers[seq])
            assert answers[good] == ("ack", "")
            # Broken envelopes: no sequence number to nack, but counted and survived.
            peer.sock.send_multipart([b"BOGUS", b"x"])
            peer.sock.send_multipart([b"DATA", b"short"])
            peer.sock.send_multipart([b"GET", b"\xc1"])
            with BufferClient(server.endpoint, retry_s=0.2) as client:
                for _ in range(200):  # the client's request may overtake the raw peer's messages
                    if (m := client.metrics())["rejected_bad_message"] >= 3:
                        break
            for reason in sent.values():
                assert m[f"rejected_{reason}"] == 1, m
            assert m["rejected_bad_message"] == 3 and m["received"] == 1, m
        finally:
            peer.close()


def test_a_bad_frame_in_a_batch_is_nacked_alone_and_a_bad_envelope_is_counted() -> None:
    with server_thread(max_frame_bytes=20_000) as server:
        peer = RawPeer(server.endpoint)
        try:
            frames = [to_msgpack(make_trajectory(1)), b"\xc1 garbage", to_msgpack(make_trajectory(2))]
            seqs = peer.send_many(frames)
            answers = peer.answers(3)
            assert [answers[s][0] for s in seqs] == ["ack", "nack", "ack"], answers
            assert answers[seqs[1]][1].startswith("garbage:")
            # Three frames but two sequence numbers: nothing can be acked or nacked; counted, survived.
            peer.sock.send_multipart([p.DATA, p.pack_u64(1), p.pack_seqs([90, 91]), *frames])
            last = peer.send_data(to_msgpack(make_trajectory(3)))
            assert peer.answers(1)[last] == ("ack", "")
            m = server.metrics()
            assert (m["received"], m["rejected_garbage"], m["rejected_bad_message"]) == (3, 1, 1), m
        finally:
            peer.close()


def test_server_survives_a_flood_of_mutated_frames() -> None:
    rng = np.random.default_rng(1)
    good = to_msgpack(make_trajectory(0, tokens=32))
    with server_thread() as server:
        peer = RawPeer(server.endpoint)
        try:
            n = 2000
            for k in range(n):
                frame = bytearray(good)
                for _ in range(rng.integers(1, 4)):
                    frame[rng.integers(len(frame))] = rng.integers(256)
                peer.send_data(bytes(frame[: rng.integers(1, len(frame) + 1)] if k % 3 == 0 else frame))
            answers = peer.answers(n)  # every DATA message answered, ack or nack
            last = peer.send_data(to_msgpack(make_trajectory(10**6)))
            assert peer.answers(1)[last] == ("ack", "")
            acks = sum(kind == "ack" for kind, _ in answers.values())
            m = server.metrics()
            assert m["received"] + m["duplicates"] == acks + 1
            assert sum(v for k, v in m.items() if k.startswith("rejected_")) == n - acks
        finally:
            peer.close()


async def test_async_sender_learns_of_rejections_and_oversize_fails_locally() -> None:
    with server_thread() as server:
        async with AsyncSender(server.endpoint, max_frame_bytes=10_000) as sender:
            bad = msgspec.structs.replace(make_trajectory(1), schema_version=99)
            await sender.send(bad)
            await sender.send(make_trajectory(2))
            await sender.flush(10)
            assert sender.stats.acked == 1 and sender.stats.nacked_by_reason == {"schema_version": 1}
            assert sender.core.nack_log[0][0] == bad.id
            with pytest.raises(ValueError, match=r"t3: frame of .* exceeds max_frame_bytes"):
                await sender.send(make_trajectory(3, tokens=4096))


def _with(**changes: object) -> bytes:
    """A well-typed trajectory frame with values no episode produces."""
    t = make_trajectory(11, tokens=8)
    turn = t.turns[0]
    for name, value in changes.items():
        if name in ("logprobs", "versions", "completion_ids", "loss_mask"):
            array = getattr(turn, name).copy()
            array[3] = value
            setattr(turn, name, array)
        else:
            setattr(t, name, value)
    return to_msgpack(t)


@pytest.mark.parametrize(("frame", "place"), [
    (_with(reward=float("nan")), "reward: nan"),
    (_with(rewards={"correct": float("inf")}), "rewards['correct']: inf"),
    (_with(metrics={"m": float("-inf")}), "metrics['m']: -inf"),
    (_with(logprobs=float("nan")), "turns[0].logprobs[3]: nan"),
    (_with(logprobs=0.5), "turns[0].logprobs[3]: 0.5"),
    (_with(completion_ids=-1), "turns[0].completion_ids[3]: -1 (negative)"),
    (_with(versions=-7), "turns[0].versions[3]: -7 (negative)"),
    (_with(loss_mask=7), "turns[0].loss_mask: values other than 0 and 1"),
    (_with(sample_index=-1), "sample_index: -1"),
])  # fmt: skip
def test_values_no_episode_produces_are_rejected_and_nothing_is_stored(frame: bytes, place: str) -> None:
    with pytest.raises(Rejected, match="invalid: " + re.escape(place)):
        decode_trajectory(frame, max_bytes=20_000)
    with server_thread(max_frame_bytes=20_000) as server:
        peer = RawPeer(server.endpoint)
        try:
            bad, good = peer.send_data(frame), peer.send_data(to_msgpack(make_trajectory(12)))
            answers = peer.answers(2)
            assert answers[bad][0] == "nack" and place in answers[bad][1] and answers[good] == ("ack", "")
            with BufferClient(server.endpoint, retry_s=0.2) as client:
                m = client.metrics()
            assert m["rejected_invalid"] == 1 and m["received"] == 1, m  # only the good one is stored
        finally:
            peer.close()


def test_a_sender_that_ignores_its_credits_cannot_fill_the_buffer() -> None:
    with server_thread(max_frame_bytes=20_000, sender_credits=8) as server:
        peer = RawPeer(server.endpoint)  # says HELLO, then sends without waiting for credits
        try:
            seqs = peer.send_many([to_msgpack(make_trajectory(k)) for k in range(12)])
            answers = peer.answers(12)
            assert [answers[s][0] for s in seqs] == ["ack"] * 8 + ["nack"] * 4
            assert answers[seqs[-1]][1] == "over_capacity: sent past its credits (granted 8)"
            with BufferClient(server.endpoint, retry_s=0.2) as client:
                m = client.metrics()
            assert m["received"] == 8 and m["rejected_over_capacity"] == 4, m
        finally:
            peer.close()


def test_a_sender_that_never_says_hello_fills_the_buffer_to_its_capacity_only() -> None:
    with server_thread(max_frame_bytes=20_000, capacity=10) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        try:
            frames = [to_msgpack(make_trajectory(k)) for k in range(25)]
            sock.send_multipart([p.DATA, p.pack_u64(5), p.pack_seqs(list(range(25))), *frames])
            with BufferClient(server.endpoint, retry_s=0.2) as client:
                for _ in range(200):  # bounded: until the server has handled the message
                    if (m := client.metrics())["received"] + m["rejected_over_capacity"] >= 25:
                        break
            # kept up to capacity (a restarted buffer's senders resend after their HELLO), no further
            assert m["received"] == 10 and m["pending"] + m["ready"] == 10 and m["rejected_over_capacity"] == 15, m
        finally:
            sock.close(linger=0)


def test_a_frame_far_past_the_limit_is_never_taken_whole() -> None:
    with server_thread(max_frame_bytes=20_000) as server:
        peer = RawPeer(server.endpoint)
        try:
            huge = peer.send_data(b"\x00" * (max_frame_limit(20_000) + 1))  # ZeroMQ drops the connection
            near = peer.send_data(to_msgpack(make_trajectory(5, tokens=4096)))  # over the limit, under 2x
            answers = peer.answers(1)  # the first answer after reconnecting
            assert huge not in answers and answers[near][0] == "nack" and "oversized" in answers[near][1]
            with BufferClient(server.endpoint, retry_s=0.2) as client:
                m = client.metrics()
            assert m["rejected_oversized"] == 1 and m["received"] == 0, m  # the huge one was never decoded
        finally:
            peer.close()
