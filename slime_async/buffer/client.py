"""The trainer's handle on the buffer server: `get_batch`, `set_version`, `metrics`, over ZeroMQ.

Plain synchronous calls (the trainer loop is a lockstep loop). Each request carries a random id and
is resent every `retry_s` until answered, so a buffer that restarts mid-request still answers it,
and the same id never yields two different batches.

The trainer loop:

    client = BufferClient(endpoint)
    client.set_version(v, restarted=True)        # at start: v from the checkpoint (0 when fresh)
    while ...:
        batch = client.get_batch(B, timeout=60)  # whole groups, >= B trajectories
        ... train on batch.groups ...
        client.set_version(v + 1)                # reports every batch received so far as trained (applied)
        ... every train.checkpoint_every steps, a checkpoint at v + 1 ...
        client.set_version(v + 1, committed=v + 1)  # what it holds is trained for good
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import zmq

from slime_async.buffer.core import Batch
from slime_async.transport import protocol as p
from slime_async.transport.security import secure_client
from slime_async.types import Group, Trajectory, from_msgpack


def _new_request_id() -> int:
    # Random, not a counter: batch ids live in the buffer's WAL across trainer restarts, and a
    # restarted trainer must never ask with an id that names an old batch.
    return int.from_bytes(os.urandom(8), "little") >> 2


class BufferClient:
    """Talks to one buffer server from the trainer process."""

    def __init__(
        self,
        endpoint: str,
        *,
        curve_dir: str | Path | None = None,
        retry_s: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.retry_s = retry_s
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        secure_client(self._sock, endpoint, curve_dir)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._unreported: list[int] = []
        """Batch ids received and not yet reported trained."""
        self._returned: list[int] = []
        """Batch ids that arrived after their request was given up: handed back at the next set_version."""
        self._given_up: set[int] = set()

    def get_batch(self, num_trajectories: int, timeout: float) -> Batch:
        """Block until the buffer hands out >= `num_trajectories` trajectories in whole groups.

        Raises TimeoutError if not enough are ready within `timeout` seconds."""
        request_id = _new_request_id()
        body = p.encode(p.GetBatch(request_id=request_id, num_trajectories=num_trajectories, timeout_s=timeout))
        # The server answers TIMEOUT itself at `timeout`; our own deadline only covers a dead server.
        try:
            kind, frames = self._request([p.GET, body], request_id, timeout + 2 * self.retry_s + 5.0)
        except TimeoutError:
            self._given_up.add(request_id)  # if its batch still comes, it is handed back, not lost
            raise
        if kind == p.TIMEOUT:
            raise TimeoutError(f"buffer at {self.endpoint}: fewer than {num_trajectories} ready within {timeout} s")
        batch = _read_batch(frames)
        self._unreported.append(batch.batch_id)
        return batch

    def set_version(
        self, version: int, trained: list[int] | None = None, restarted: bool = False, timeout: float = 30.0,
        committed: int | None = None,
    ) -> None:
        """Tell the buffer the trainer's version, and which batches it has trained.

        `trained=None` reports every batch this client received and has not reported yet.
        `restarted=True` (once, at start-up after loading the checkpoint at `version`) puts every
        batch handed out and not trained by then back into the buffer. `committed`: a checkpoint
        holds the steps up to this version (the batches they trained are then trained for good)."""
        report = list(self._unreported) if trained is None else list(trained)
        request_id = _new_request_id()
        returned = list(self._returned)
        body = p.encode(p.SetVersion(
            request_id=request_id, version=version, trained=report, restarted=restarted, returned=returned,
            committed=committed,
        ))
        self._request([p.VERSION, body], request_id, timeout)
        self._unreported = [b for b in self._unreported if b not in set(report)]
        self._returned = [b for b in self._returned if b not in set(returned)]

    def metrics(self, timeout: float = 10.0) -> dict[str, int]:
        """The server's counters: received, trained, buffered, dropped_*, rejected_*, peers..."""
        request_id = _new_request_id()
        _, frames = self._request([p.METRICS, p.pack_u64(request_id)], request_id, timeout)
        return msgspec.msgpack.decode(frames[0], type=dict[str, int])

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, msg: list[bytes], request_id: int, timeout: float) -> tuple[p.Payload, list[p.Payload]]:
        deadline = time.monotonic() + timeout
        self._sock.send_multipart(msg)
        resend_at = time.monotonic() + self.retry_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"buffer at {self.endpoint} did not answer within {timeout:.1f} s; is it running?")
            if self._sock.poll(max(1, int((min(deadline, resend_at) - now) * 1000)), zmq.POLLIN):
                frames = p.recv_frames(self._sock)  # trajectories decode from ZeroMQ's buffer, no copy
                if len(frames) >= 2 and len(frames[1]) == 8:
                    answered = p.unpack_u64(frames[1], "request id")
                    if answered == request_id:
                        return frames[0], frames[2:]
                    if frames[0] == p.BATCH and answered in self._given_up:
                        self._given_up.discard(answered)
                        self._returned.append(answered)  # a batch we stopped waiting for: hand it back
                continue
            if time.monotonic() >= resend_at:
                self._sock.send_multipart(msg)  # the buffer may have restarted and lost it
                resend_at = time.monotonic() + self.retry_s


def _read_batch(frames: list[p.Payload]) -> Batch:
    """A BATCH message's header and trajectory frames as a Batch of whole groups."""
    header = msgspec.msgpack.decode(frames[0], type=p.BatchHeader)
    payloads = frames[1:]
    if sum(g.size for g in header.groups) != len(payloads):
        raise ValueError(f"BATCH {header.batch_id}: header lists {sum(g.size for g in header.groups)} "
                         f"trajectories, message has {len(payloads)}")
    groups, k = [], 0
    for g in header.groups:
        trajs = [from_msgpack(f, Trajectory) for f in payloads[k : k + g.size]]
        groups.append(Group(group_id=g.group_id, task_id=g.task_id, trajectories=trajs))
        k += g.size
    return Batch(header.batch_id, header.version, groups)
