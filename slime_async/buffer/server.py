"""The buffer server: one ROUTER socket in front of a `Buffer`, for senders and the trainer's client.

It runs in its own process (`python -m slime_async.buffer SETTINGS_JSON`, which prints
`READY <endpoint>` once bound) or in any thread that calls `serve()`. One loop, no locks:

    drain messages -> decode, de-duplicate, store (WAL) -> commit the WAL -> ack / nack
    -> grant credits while there is room -> answer the trainer's waiting requests
    -> release timed-out groups -> forget senders silent for longer than the heartbeat timeout

Nothing is acked or handed to the trainer before the WAL has it, so a kill -9 at any point loses
nothing that anyone was told about.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from slime_async.buffer.core import Buffer
from slime_async.buffer.policies import SamplingPolicy
from slime_async.config.schema import BufferConfig, Config
from slime_async.transport import protocol as p
from slime_async.transport.frames import Rejected, RejectReason, decode_trajectory
from slime_async.transport.security import secure_server

log = logging.getLogger(__name__)

_DRAIN_MESSAGES = 512
_DRAIN_BYTES = 2 * 2**20
"""Most messages (or bytes) handled between two WAL commits: bounds ack latency under a flood,
while one commit (one writev) still covers many trajectories."""


def max_frame_limit(max_frame_bytes: int) -> int:
    """The largest frame the buffer's socket receives at all (`zmq.MAXMSGSIZE`)."""
    return max(2 * max_frame_bytes, max_frame_bytes + 2**20)


class ServerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a buffer server process needs: its config section plus the two rollout numbers it uses."""

    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    group_size: int
    """Trajectories per complete group (`rollout.group_size`)."""
    max_staleness: int
    """The staleness bound eta (`rollout.max_staleness`)."""
    wal_dir: str | None = None
    """Resolved WAL directory, or None for none."""

    @classmethod
    def from_config(cls, cfg: Config) -> ServerSettings:
        wal_dir = cfg.buffer.wal_dir
        if wal_dir is not None and not Path(wal_dir).is_absolute():
            wal_dir = str(Path(cfg.run.dir) / cfg.run.name / wal_dir)
        return cls(
            buffer=cfg.buffer, group_size=cfg.rollout.group_size, max_staleness=cfg.rollout.max_staleness,
            wal_dir=wal_dir,
        )


@dataclass
class _Peer:
    name: str
    session: int
    received: int = 0
    granted: int = 0
    last_seen: float = 0.0


@dataclass
class _Waiting:
    ident: bytes
    request: p.GetBatch
    deadline: float


class BufferServer:
    """Owns the socket and the buffer. Call `serve()` (blocking) or `step()` in your own loop."""

    def __init__(
        self, settings: ServerSettings, *, policy: SamplingPolicy | None = None, context: zmq.Context | None = None
    ) -> None:
        cfg = settings.buffer
        self.cfg = cfg
        kwargs: dict[str, Any] = {
            "policy": policy or cfg.policy, "group_timeout_s": cfg.group_timeout_s, "compact_every": cfg.compact_every,
        }
        if settings.wal_dir is not None:
            self.buffer = Buffer.open(
                settings.wal_dir, settings.group_size, settings.max_staleness, fsync=cfg.wal_fsync, **kwargs
            )
        else:
            self.buffer = Buffer(settings.group_size, settings.max_staleness, **kwargs)
        self._ctx = context or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self._auth = secure_server(self.sock, cfg.endpoint, cfg.curve_dir)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped, not raised
        # ZeroMQ drops a peer that sends a frame past this before taking it whole (a 300 MB frame was
        # read into memory, then rejected): senders refuse frames over max_frame_bytes themselves,
        # and one somewhat over it still reaches `decode_trajectory`, which nacks it with the reason
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_limit(cfg.max_frame_bytes))
        p.zero_copy_sends(self.sock)  # BATCH frames go out as the buffer holds them
        self.sock.bind(cfg.endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[bytes, _Peer] = {}
        self._waiting: list[_Waiting] = []
        self._timed_out: deque[int] = deque(maxlen=1024)
        self.rejected: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self.peers_expired = 0
        self.sessions = 0
        self._closed = False

    # -- loop -------------------------------------------------------------------------------------
    def serve(self, stop: threading.Event | StopFlag | None = None) -> None:
        """Run until `stop` is set (or forever)."""
        while stop is None or not stop.is_set():
            self.step(0.1 if stop is not None else 1.0)

    def step(self, max_wait: float) -> None:
        """Wait up to `max_wait` for messages, handle them and every timer that is due."""
        now = time.monotonic()
        waits = [max_wait, self.cfg.heartbeat_s]
        if self._waiting:
            waits.append(min(w.deadline for w in self._waiting) - now)
        if (t := self.buffer.next_timeout(now)) is not None:
            waits.append(t)
        acks: defaultdict[bytes, list[int]] = defaultdict(list)
        out: list[list[bytes]] = []
        if self.sock.poll(max(0, int(min(waits) * 1000)), zmq.POLLIN):
            drained = 0
            for _ in range(_DRAIN_MESSAGES):
                try:
                    # Trajectory frames stay in ZeroMQ's buffer: the WAL, the buffer and BATCH use them as is.
                    frames = p.recv_frames(self.sock, zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames, acks, out)
                drained += sum(map(len, frames))
                if drained >= _DRAIN_BYTES:
                    break
        self.buffer.tick()
        self.buffer.commit()  # durable before anyone hears about it
        for ident, seqs in acks.items():
            self.sock.send_multipart([ident, p.ACK, p.encode(p.Ack(seqs=seqs))])
        for msg in out:
            self.sock.send_multipart(msg, copy=False)
        self._answer_waiting()
        self._grant()
        self._expire_peers()

    # -- messages ---------------------------------------------------------------------------------
    def _handle(self, frames: list[p.Payload], acks: dict[bytes, list[int]], out: list[list[bytes]]) -> None:
        ident = frames[0]
        kind = frames[1] if len(frames) > 1 else b""
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_seen = time.monotonic()
        try:
            if kind == p.DATA:
                self._on_data(ident, peer, frames, acks, out)
            elif kind == p.HELLO:
                self._on_hello(ident, frames)
            elif kind == p.PING:
                session = p.unpack_u64(_frame(frames, 2, "PING session"), "PING session")
                known = peer is not None and peer.session == session
                out.append([ident, p.PONG] if known else [ident, p.RESET, p.pack_u64(session)])
            elif kind == p.GET:
                self._on_get(ident, msgspec.msgpack.decode(_frame(frames, 2, "GET body"), type=p.GetBatch))
            elif kind == p.VERSION:
                req = msgspec.msgpack.decode(_frame(frames, 2, "VERSION body"), type=p.SetVersion)
                self.buffer.set_version(
                    req.version, trained=req.trained, restarted=req.restarted, returned=req.returned,
                    committed=req.committed,
                )
                self.buffer.commit()
                out.append([ident, p.OK, p.pack_u64(req.request_id)])
            elif kind == p.METRICS:
                request_id = _frame(frames, 2, "METRICS request id")
                out.append([ident, p.METRICS, request_id, p.encode(self.metrics())])
            else:
                raise Rejected(RejectReason.BAD_MESSAGE, f"unknown message kind {kind[:32]!r}")
        except Rejected as exc:
            self._count_reject(exc, ident)
        except (ValueError, msgspec.DecodeError) as exc:
            self._count_reject(Rejected(RejectReason.BAD_MESSAGE, f"malformed {kind[:32]!r} message: {exc}"), ident)

    def _on_data(
        self, ident: bytes, peer: _Peer | None, frames: list[p.Payload], acks: dict[bytes, list[int]],
        out: list[list[bytes]],
    ) -> None:
        if len(frames) < 5:
            raise Rejected(RejectReason.BAD_MESSAGE, f"DATA message has {len(frames) - 1} frames, expected >= 4")
        session = p.unpack_u64(frames[2], "DATA session")
        payloads = frames[4:]
        seqs = p.unpack_seqs(frames[3], len(payloads))
        # Capacity holds against senders that ignore flow control: what a known sender sends past its
        # credits is nacked; a sender we do not know may fill the buffer up to `capacity`, no further
        # (unacked, so that after its HELLO it resends under credits: an honest one loses nothing).
        if peer is not None and peer.session == session:
            allowed = max(0, min(len(payloads), peer.granted - peer.received))
            peer.received += len(payloads)
        else:
            if peer is None:
                # A sender we do not know (we restarted, or forgot it): keep its data, ask it to say
                # HELLO so that it gets credits and resends whatever we never acked.
                out.append([ident, p.RESET, p.pack_u64(session)])
            allowed = max(0, self.cfg.capacity - self.buffer.stored)  # an earlier session's data: the same bound
        ack = acks[ident]
        for i, (seq, payload) in enumerate(zip(seqs, payloads, strict=True)):
            if i >= allowed:
                in_session = peer is not None and peer.session == session
                over = Rejected(RejectReason.OVER_CAPACITY, f"sent past its credits (granted {peer.granted})"
                                if in_session and peer is not None else f"the buffer is full ({self.cfg.capacity})")
                self._count_reject(over, ident)
                if in_session:
                    out.append([ident, p.NACK, p.pack_u64(seq), str(over).encode()])
                continue
            try:
                trajectory = decode_trajectory(payload, self.cfg.max_frame_bytes)
            except Rejected as exc:
                self._count_reject(exc, ident)
                out.append([ident, p.NACK, p.pack_u64(seq), str(exc).encode()])
                continue
            self.buffer.add(trajectory, payload)  # a duplicate is acked again, stored once
            ack.append(seq)

    def _on_hello(self, ident: bytes, frames: list[p.Payload]) -> None:
        session = p.unpack_u64(_frame(frames, 2, "HELLO session"), "HELLO session")
        hello = msgspec.msgpack.decode(_frame(frames, 3, "HELLO body"), type=p.Hello)
        if hello.protocol != p.PROTOCOL_VERSION:
            raise Rejected(
                RejectReason.BAD_MESSAGE,
                f"sender {hello.sender} speaks protocol {hello.protocol}, this buffer {p.PROTOCOL_VERSION}: "
                "run the same slime_async version on both sides",
            )
        self._peers[ident] = peer = _Peer(hello.sender, session, last_seen=time.monotonic())
        self.sessions += 1
        if self.buffer.stored < self.cfg.capacity:  # its first credits at once: DATA may follow in this step
            peer.granted = self.cfg.sender_credits
            self.sock.send_multipart([ident, p.GRANT, p.pack_u64(session), p.pack_u64(peer.granted)])

    def _on_get(self, ident: bytes, req: p.GetBatch) -> None:
        for w in self._waiting:
            if w.request.request_id == req.request_id:
                w.ident = ident  # a resend of a request we are already waiting on
                return
        if self.buffer.is_settled(req.request_id):
            return  # a resend that crossed its answer: the batch is already trained or handed back
        if req.request_id in self._timed_out:
            self.sock.send_multipart([ident, p.TIMEOUT, p.pack_u64(req.request_id)])
            return
        self._waiting.append(_Waiting(ident, req, time.monotonic() + req.timeout_s))

    def _answer_waiting(self) -> None:
        now = time.monotonic()
        still: list[_Waiting] = []
        for w in self._waiting:
            req = w.request
            if self.buffer.is_settled(req.request_id):
                continue  # answered, and settled by a VERSION handled in the same step
            batch = self.buffer.get_batch(req.num_trajectories, req.request_id)
            if batch is not None:
                self.buffer.commit()  # the delivery is on disk before the trainer can see it
                # The frames as the senders sent them: no re-encoding on the way to the trainer.
                header = p.encode(p.BatchHeader.of(batch.batch_id, batch.version, batch.groups))
                frames = self.buffer.frames_of(batch)
                self.sock.send_multipart([w.ident, p.BATCH, p.pack_u64(req.request_id), header, *frames], copy=False)
            elif now >= w.deadline:
                self._timed_out.append(req.request_id)
                self.sock.send_multipart([w.ident, p.TIMEOUT, p.pack_u64(req.request_id)])
            else:
                still.append(w)
        self._waiting = still

    def _grant(self) -> None:
        if self.buffer.stored >= self.cfg.capacity:
            return  # full: senders wait until the trainer takes batches
        for ident, peer in self._peers.items():
            target = peer.received + self.cfg.sender_credits
            if target > peer.granted:
                peer.granted = target
                self.sock.send_multipart([ident, p.GRANT, p.pack_u64(peer.session), p.pack_u64(target)])

    def _expire_peers(self) -> None:
        cutoff = time.monotonic() - self.cfg.heartbeat_timeout_s
        for ident in [i for i, peer in self._peers.items() if peer.last_seen < cutoff]:
            peer = self._peers.pop(ident)
            self.peers_expired += 1
            log.warning("buffer: sender %s silent for %.1f s: presumed dead", peer.name, self.cfg.heartbeat_timeout_s)

    def _count_reject(self, exc: Rejected, ident: bytes) -> None:
        reason = exc.reason.value
        self.rejected[reason] += 1
        # one line per reason every 10 s at most: a peer sending junk must not flood the log (the
        # counters in the metrics hold every one)
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) >= 10.0:
            self._logged[reason] = now
            name = self._peers[ident].name if ident in self._peers else ident.hex()
            log.warning("buffer: rejected a message from %s (%d %s so far): %s", name, self.rejected[reason],
                        reason, exc)

    # -- metrics, shutdown ------------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        out = self.buffer.metrics()
        for reason in RejectReason:
            out[f"rejected_{reason.value}"] = self.rejected.get(reason.value, 0)
        out["peers"] = len(self._peers)
        out["peers_expired"] = self.peers_expired
        out["sessions"] = self.sessions
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.buffer.close()


def _frame(frames: list[p.Payload], index: int, what: str) -> p.Payload:
    if len(frames) <= index:
        raise ValueError(f"missing frame: {what}")
    return frames[index]


class StopFlag:
    """`serve`'s stop, set from a signal handler. No lock: a handler runs on the main thread between
    any two bytecodes, also inside itself when the next signal comes, and one that took
    `threading.Event`'s lock deadlocked there (seen after a launcher's death: four nested handlers)."""

    def __init__(self) -> None:
        self._set = False

    def set(self, *_: object) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def main(argv: list[str] | None = None) -> None:
    """`python -m slime_async.buffer SETTINGS_JSON`: serve until SIGTERM or SIGINT."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m slime_async.buffer SETTINGS_JSON (a ServerSettings as JSON)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = msgspec.json.decode(args[0], type=ServerSettings)
    server = BufferServer(settings)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    print(f"READY {server.endpoint}", flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
