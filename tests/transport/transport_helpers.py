"""Helpers for the transport tests: trajectories, a buffer server on a thread, a raw DEALER peer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import numpy as np
import zmq

from slime_async.buffer import BufferServer, ServerSettings
from slime_async.config.schema import BufferConfig
from slime_async.transport import protocol as p
from slime_async.types import StopReason, Trajectory, Turn


def make_trajectory(k: int = 0, tokens: int = 16, version: int = 0, group: str | None = None) -> Trajectory:
    return Trajectory(
        id=f"t{k}", task_id="task", group_id=group or f"g{k}", sample_index=0, stop_reason=StopReason.DONE,
        turns=[Turn(prompt_ids=np.arange(4), completion_ids=np.arange(tokens), logprobs=np.zeros(tokens, np.float32),
                    versions=np.full(tokens, version))],
    )


@contextmanager
def server_thread(**buffer: object) -> Iterator[BufferServer]:
    """A real BufferServer (real ROUTER socket) served by a thread of this process; group size 1."""
    buffer.setdefault("endpoint", "tcp://127.0.0.1:0")
    buffer.setdefault("heartbeat_s", 0.2)
    buffer.setdefault("heartbeat_timeout_s", 1.0)
    server = BufferServer(ServerSettings(buffer=BufferConfig(**buffer), group_size=1, max_staleness=100))  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(10)
        server.close()


class RawPeer:
    """A DEALER that speaks the sender protocol by hand, to send what a real sender never would."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart([p.HELLO, p.pack_u64(1), p.encode(p.Hello(sender="raw"))])
        self.seq = 0

    def send_data(self, payload: bytes) -> int:
        self.seq += 1
        self.sock.send_multipart([p.DATA, p.pack_u64(1), p.pack_u64(self.seq), payload])
        return self.seq

    def send_many(self, payloads: list[bytes]) -> list[int]:
        """One DATA message carrying all `payloads`; returns their sequence numbers."""
        seqs = list(range(self.seq + 1, self.seq + 1 + len(payloads)))
        self.seq += len(payloads)
        self.sock.send_multipart([p.DATA, p.pack_u64(1), p.pack_seqs(seqs), *payloads])
        return seqs

    def answers(self, n: int, timeout_s: float = 10.0) -> dict[int, tuple[str, str]]:
        """Wait for the ACK or NACK of `n` DATA messages: seq -> ("ack", "") or ("nack", reason)."""
        out: dict[int, tuple[str, str]] = {}
        while len(out) < n:
            assert self.sock.poll(int(timeout_s * 1000)), f"no answer from the buffer after {len(out)} of {n}"
            frames = self.sock.recv_multipart()
            if frames[0] == p.ACK:
                for seq in msgspec.msgpack.decode(frames[1], type=p.Ack).seqs:
                    out[seq] = ("ack", "")
            elif frames[0] == p.NACK:
                out[p.unpack_u64(frames[1], "seq")] = ("nack", frames[2].decode())
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
