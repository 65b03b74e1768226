"""The buffer server's handling of the trainer's requests, stepped by hand over a real socket.

The server runs `step()` in this thread and the peers are real DEALER sockets on an inproc
endpoint of the same context: a message is in the server's queue as soon as `send_multipart`
returns, so what one `step()` sees together is exact, not a matter of timing.
"""

from __future__ import annotations

import msgspec
import zmq
from sender_main import make

from slime_async.buffer import BufferServer, ServerSettings
from slime_async.config.schema import BufferConfig
from slime_async.transport import protocol as p
from slime_async.types import to_msgpack


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def recv_kinds(sock: zmq.Socket) -> list[tuple[bytes, int]]:
    """(kind, request id) of every message waiting on `sock`."""
    out = []
    while sock.poll(0, zmq.POLLIN):
        frames = sock.recv_multipart()
        out.append((frames[0], p.unpack_u64(frames[1], "request id")))
    return out


def test_a_get_resent_across_its_answer_and_the_training_report_takes_no_new_batch() -> None:
    # The client resends GET until answered. If a resend crosses the BATCH and reaches the server
    # in the same step as the VERSION that reports the batch trained, the server must not hand a
    # second batch out under that id: the client ignores it, and its groups would never be trained.
    ctx = zmq.Context()
    settings = ServerSettings(buffer=BufferConfig(endpoint="inproc://buffer-requests"), group_size=1, max_staleness=100)
    server = BufferServer(settings, context=ctx)
    sender, trainer = dealer(ctx, server.endpoint), dealer(ctx, server.endpoint)
    try:
        sender.send_multipart([p.HELLO, p.pack_u64(1), p.encode(p.Hello(sender="raw"))])
        frames = [to_msgpack(make("t", k, 1, 0, 8)) for k in range(3)]
        sender.send_multipart([p.DATA, p.pack_u64(1), p.pack_seqs([0, 1, 2]), *frames])
        server.step(0.0)
        assert server.metrics()["ready"] == 3

        get = [p.GET, p.encode(p.GetBatch(request_id=5, num_trajectories=1, timeout_s=5.0))]
        trainer.send_multipart(get)
        server.step(0.0)
        assert recv_kinds(trainer) == [(p.BATCH, 5)]

        trainer.send_multipart(get)  # the resend that crossed the answer
        trainer.send_multipart([p.VERSION, p.encode(p.SetVersion(request_id=6, version=1, trained=[5], committed=1))])
        server.step(0.0)
        assert recv_kinds(trainer) == [(p.OK, 6)]
        m = server.metrics()
        assert (m["trained"], m["delivered"], m["ready"]) == (1, 0, 2), m

        trainer.send_multipart(get)  # and one arriving in a later step is ignored as well
        server.step(0.0)
        assert recv_kinds(trainer) == [] and server.metrics()["ready"] == 2
    finally:
        sender.close()
        trainer.close()
        server.close()
        ctx.term()


def test_malformed_trainer_requests_are_rejected_and_the_server_goes_on() -> None:
    # Each of these once stopped the server (exit 1): a GET for 0 trajectories, or a request id
    # that cannot go back as a u64. Now the wire schema refuses them, counted, and it goes on.
    ctx = zmq.Context()
    settings = ServerSettings(buffer=BufferConfig(endpoint="inproc://buffer-bad-requests"), group_size=1,
                              max_staleness=100)
    server = BufferServer(settings, context=ctx)
    trainer = dealer(ctx, server.endpoint)
    bad = [
        [p.GET, msgspec.msgpack.encode({"request_id": 1, "num_trajectories": 0, "timeout_s": 1.0})],
        [p.GET, msgspec.msgpack.encode({"request_id": -1, "num_trajectories": 1, "timeout_s": 1.0})],
        [p.GET, msgspec.msgpack.encode({"request_id": 2**63, "num_trajectories": 1, "timeout_s": 1.0})],
        [p.GET, msgspec.msgpack.encode({"request_id": 3, "num_trajectories": 1, "timeout_s": -5.0})],
        [p.VERSION, msgspec.msgpack.encode({"request_id": -1, "version": 1})],
        [p.VERSION, msgspec.msgpack.encode({"request_id": 4, "version": -3})],
        [p.VERSION, msgspec.msgpack.encode({"request_id": 5, "version": 1, "trained": [-1]})],
    ]
    try:
        for msg in bad:
            trainer.send_multipart(msg)
            server.step(0.0)
        m = server.metrics()
        assert m["rejected_bad_message"] == len(bad) and m["version"] == 0, m
        trainer.send_multipart([p.VERSION, p.encode(p.SetVersion(request_id=6, version=2))])
        server.step(0.0)
        assert recv_kinds(trainer) == [(p.OK, 6)] and server.metrics()["version"] == 2  # still serving
    finally:
        trainer.close()
        server.close()
        ctx.term()
