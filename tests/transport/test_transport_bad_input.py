"""Bad input on the wire: each kind is rejected with its reason, counted, told to the sender, survived."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from transport_helpers import RawPeer, make_trajectory, server_thread

from slime_async.buffer import BufferClient
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
