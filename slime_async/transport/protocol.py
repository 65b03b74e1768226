"""The messages on the buffer's ZeroMQ socket: what each frame is, who sends it, what it answers.

One ROUTER socket (the buffer server) talks to many DEALER sockets: rollout workers (senders)
and the trainer's client. Every message is a multipart ZeroMQ message whose first frame names its
kind; the other frames are raw integers, raw trajectory bytes (`types.to_msgpack`) or small
msgspec Structs. ROUTER adds the peer's routing id in front; the server reads it as the peer's
session (a sender that reconnects uses a new one).

Sender -> server                         server -> sender
  HELLO  u64 session, Hello                GRANT  u64 session, u64 total credits granted
  DATA   u64 session, seqs, frame * n       ACK    Ack (sequence numbers, batched)
  PING   u64 session                       NACK   u64 seq, reason (utf-8): the item is rejected
                                           PONG
                                           RESET  u64 session: unknown, say HELLO, resend

Trainer client -> server                 server -> trainer client
  GET      GetBatch                        BATCH    u64 request id, BatchHeader, frame * n
  VERSION  SetVersion                      TIMEOUT  u64 request id
  METRICS  u64 request id                  OK       u64 request id
                                           METRICS  u64 request id, msgpack dict

DATA carries n >= 1 trajectories: `seqs` is n little-endian u64 sequence numbers, one per frame
that follows (so the one-item DATA of protocol 1 is still valid). BATCH carries the trajectories'
frames exactly as the senders sent them (the buffer never re-encodes them), after a header that
says how they form groups. Each frame is its own ZeroMQ frame: one message moves many trajectories
with no copy into a container, and each can still be rejected or acked on its own.

Credits are absolute ("you may have sent up to N items in this session"), so a lost or repeated
GRANT never leaves a sender stuck or over its window.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec
import numpy as np
import zmq

from slime_async.types import Group

HELLO = b"HELLO"
DATA = b"DATA"
PING = b"PING"
GRANT = b"GRANT"
ACK = b"ACK"
NACK = b"NACK"
PONG = b"PONG"
RESET = b"RESET"
GET = b"GET"
VERSION = b"VERSION"
METRICS = b"METRICS"
BATCH = b"BATCH"
TIMEOUT = b"TIMEOUT"
OK = b"OK"

PROTOCOL_VERSION = 2
"""Bumped when a message changes shape; a HELLO from another protocol version is refused.
2: DATA and BATCH carry many trajectory frames per message."""

ZERO_COPY_BYTES = 16 * 2**10
"""Frames at least this large cross between Python and ZeroMQ without a copy, both ways.

A copy itself is cheap (~3 us for a 49 kB trajectory), but each one is a fresh malloc that the
allocator hands back to the kernel and faults in again (12 page faults a trajectory, ~50-90 CPU-us
a hop on a VM, measured). Smaller frames are copied: pyzmq's zero-copy path has a fixed cost per
frame (its garbage-collector thread) that only large frames repay."""

Payload = bytes | memoryview
"""A received frame: small ones as bytes, large ones as a read-only view of ZeroMQ's own buffer."""

_U64 = struct.Struct("<Q")
_SEQS = np.dtype("<u8")


def zero_copy_sends(sock: zmq.Socket) -> None:
    """Send frames of `ZERO_COPY_BYTES` or more without copying them (with `copy=False`): the
    sender must not change them afterwards (trajectory frames are immutable bytes)."""
    sock.copy_threshold = ZERO_COPY_BYTES


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[Payload]:
    """Receive one multipart message; frames of `ZERO_COPY_BYTES` or more are not copied but
    returned as read-only views of the received message (which they keep alive)."""
    frames = sock.recv_multipart(flags, copy=False)
    return [f.buffer.toreadonly() if len(f) >= ZERO_COPY_BYTES else f.bytes for f in frames]


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(frame: bytes | memoryview, what: str) -> int:
    """Read a u64 frame; the error names `what` it should have been."""
    if len(frame) != _U64.size:
        raise ValueError(f"{what}: expected {_U64.size} bytes, got {len(frame)}")
    return _U64.unpack(frame)[0]


def pack_seqs(seqs: list[int]) -> bytes:
    return np.asarray(seqs, dtype=_SEQS).tobytes()


def unpack_seqs(frame: bytes | memoryview, count: int) -> list[int]:
    """Read the `count` sequence numbers of a DATA message; the error says what was wrong."""
    if count < 1 or len(frame) != count * _SEQS.itemsize:
        raise ValueError(f"DATA seqs: expected {count} x {_SEQS.itemsize} bytes for {count} frames, got {len(frame)}")
    return np.frombuffer(frame, dtype=_SEQS).tolist()


class Hello(msgspec.Struct, kw_only=True):
    """A sender's first message on a session."""

    sender: str
    """Human-readable name of the sender (host:pid, worker index), for logs and metrics."""
    protocol: int = PROTOCOL_VERSION


class Ack(msgspec.Struct, kw_only=True, array_like=True):
    """Sequence numbers the server has made durable (or already had: duplicates are acked too)."""

    seqs: list[int]


RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""Sent back as a u64 frame (clients draw 62-bit ids): a value outside would fail the answer, not the request."""
Version = Annotated[int, msgspec.Meta(ge=0)]


class GetBatch(msgspec.Struct, kw_only=True):
    """The trainer asks for at least `num_trajectories` trajectories, in whole groups."""

    request_id: RequestId
    """Chosen by the client; a resent request with the same id gets the same batch, never a second one."""
    num_trajectories: Annotated[int, msgspec.Meta(ge=1)]
    timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
    """How long the server may wait for enough ready groups before answering TIMEOUT."""


class GroupHeader(msgspec.Struct, array_like=True):
    group_id: str
    task_id: str
    size: int
    """How many of the frames that follow (after those of the groups before) belong to this group."""


class BatchHeader(msgspec.Struct, kw_only=True):
    batch_id: int
    """Equal to the request id; the trainer reports it back in SetVersion.trained."""
    version: int
    """Trainer version at which the batch was handed out (staleness was checked against it)."""
    groups: list[GroupHeader]

    @classmethod
    def of(cls, batch_id: int, version: int, groups: list[Group]) -> BatchHeader:
        return cls(
            batch_id=batch_id, version=version,
            groups=[GroupHeader(g.group_id, g.task_id, len(g.trajectories)) for g in groups],
        )


class SetVersion(msgspec.Struct, kw_only=True):
    """The trainer's version moved (or the trainer restarted), and which batches it has trained."""

    request_id: RequestId
    version: Version
    trained: list[RequestId] = []
    """Batch ids the trainer has trained on; they leave the buffer (and, at compaction, the WAL)."""
    returned: list[RequestId] = []
    """Batch ids that reached the client after it stopped waiting for them (a late answer): never
    trained, so they go back to the front of the buffer."""
    restarted: bool = False
    """The trainer restarted from the checkpoint at `version`: batches handed out and not trained by
    then (applied after that checkpoint, or never reported) go back to be handed out again."""
    committed: Version | None = None
    """A checkpoint holds every step up to this version: the batches applied so far are trained
    for good (until then a restart from an older checkpoint trains them again)."""


_encoder = msgspec.msgpack.Encoder()


def encode(obj: msgspec.Struct | dict) -> bytes:
    """Control messages are plain msgpack (no arrays); trajectories go through `types.to_msgpack`."""
    return _encoder.encode(obj)
