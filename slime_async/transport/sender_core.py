"""The sender's protocol state, without any I/O: what to send next, what is acked, when to ping.

Both drivers (`AsyncSender` for asyncio code, `SyncSender` for plain code) feed this object the
messages they receive and the current time, and send what it tells them to. Keeping the rules here
means the two drivers cannot disagree about credits, resends or sessions.

Rules:
- every item gets a sequence number and stays in `unacked` until the server acks or nacks it;
- each item in a DATA message needs a credit: `sent_in_session < granted`; grants are absolute
  per session; one DATA message carries up to `batch_items` items (`batch_bytes` of frames), so
  that the per-message cost of ZeroMQ, the event loop and the server is paid once per batch;
- a new session (after RESET, or after `heartbeat_timeout_s` of silence) requeues every unacked
  item in sequence order; duplicates this causes are removed by the buffer's de-duplication;
- acks and nacks are valid whatever session they arrive in (they are about the item, not the link).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from slime_async.transport import protocol as p

log = logging.getLogger(__name__)

AckCallback = Callable[[str], None]
"""Called with the trajectory id of each item the buffer has made durable."""
NackCallback = Callable[[str, str], None]
"""Called with the trajectory id and the server's reason for each rejected item."""


@dataclass
class SenderStats:
    """Counters of one sender; `sent == acked + nacked + unacked` at all times."""

    sent: int = 0
    acked: int = 0
    nacked: int = 0
    nacked_by_reason: Counter[str] = field(default_factory=Counter)
    resent: int = 0
    sessions: int = 0
    reconnects: int = 0
    """Sessions started because the server fell silent (not because it asked with RESET)."""


class SenderCore:
    """Sequence numbers, unacked items, credits and heartbeat timing of one sender."""

    def __init__(
        self,
        name: str | None = None,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        on_ack: AckCallback | None = None,
        on_nack: NackCallback | None = None,
        batch_items: int = 32,
        batch_bytes: int = 4 * 2**20,
    ) -> None:
        if batch_items < 1 or batch_bytes < 1:
            raise ValueError(f"batch_items and batch_bytes must be >= 1, got {batch_items}, {batch_bytes}")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.batch_items = batch_items
        self.batch_bytes = batch_bytes
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_ack = on_ack
        self.on_nack = on_nack
        self.stats = SenderStats()
        self.unacked: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        """seq -> (trajectory id, frame), oldest first."""
        self.queue: deque[int] = deque()
        """Sequence numbers waiting for a credit, oldest first (resends before new items)."""
        self.session = 0
        self.granted = 0
        self.sent_in_session = 0
        self._next_seq = 0
        self.last_recv = 0.0
        self.last_ping = 0.0
        self.nack_log: list[tuple[str, str]] = []
        """(trajectory id, reason) of every rejected item, for the caller to inspect."""

    # -- sessions -------------------------------------------------------------------------------
    def new_session(self, now: float) -> list[bytes]:
        """Start a session: forget credits, requeue every unacked item, return the HELLO to send."""
        self.session += 1
        self.granted = 0
        self.sent_in_session = 0
        self.stats.sessions += 1
        requeued = [seq for seq in self.unacked if seq not in self.queue]
        self.stats.resent += len(requeued)
        self.queue = deque(sorted({*self.queue, *self.unacked}))
        self.last_recv = now
        self.last_ping = now
        return [p.HELLO, p.pack_u64(self.session), p.encode(p.Hello(sender=self.name))]

    # -- items ----------------------------------------------------------------------------------
    def credit(self) -> int:
        """Items that may be transmitted now."""
        return max(0, self.granted - self.sent_in_session)

    def can_enqueue(self) -> bool:
        """A new item may join only when a credit is free for it behind everything already queued:
        this is the backpressure that makes `send` wait instead of buffering without bound."""
        return self.credit() > len(self.queue)

    def enqueue(self, trajectory_id: str, frame: bytes) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self.unacked[seq] = (trajectory_id, frame)
        self.queue.append(seq)
        return seq

    def next_data(self) -> list[bytes] | None:
        """The next DATA message to transmit: as many queued items as credits, `batch_items` and
        `batch_bytes` allow (always at least one when any may go), or None."""
        seqs: list[int] = []
        frames: list[bytes] = []
        size = 0
        while self.queue and self.credit() > 0 and len(seqs) < self.batch_items:
            item = self.unacked.get(self.queue[0])
            if item is None:  # acked while it waited for a resend
                self.queue.popleft()
                continue
            if seqs and size + len(item[1]) > self.batch_bytes:
                break
            seqs.append(self.queue.popleft())
            frames.append(item[1])
            size += len(item[1])
            self.sent_in_session += 1
        if not seqs:
            return None
        self.stats.sent += len(seqs)
        return [p.DATA, p.pack_u64(self.session), p.pack_seqs(seqs), *frames]

    def not_sent(self, msg: list[bytes]) -> None:
        """The socket refused `msg` (from `next_data`; no connected peer): its items go back to the front."""
        seqs = p.unpack_seqs(msg[2], len(msg) - 3)
        self.queue.extendleft(reversed(seqs))
        self.sent_in_session -= len(seqs)
        self.stats.sent -= len(seqs)

    def all_acked(self) -> bool:
        return not self.unacked

    # -- incoming -------------------------------------------------------------------------------
    def on_message(self, frames: list[bytes], now: float) -> list[bytes] | None:
        """Apply one message from the server; return a message to send back (HELLO) if needed."""
        self.last_recv = now
        kind = frames[0] if frames else b""
        try:
            if kind == p.ACK:
                for seq in msgspec.msgpack.decode(frames[1], type=p.Ack).seqs:
                    item = self.unacked.pop(seq, None)
                    if item is not None:
                        self.stats.acked += 1
                        if self.on_ack is not None:
                            self.on_ack(item[0])
            elif kind == p.GRANT:
                if p.unpack_u64(frames[1], "GRANT session") == self.session:
                    self.granted = max(self.granted, p.unpack_u64(frames[2], "GRANT total"))
            elif kind == p.NACK:
                seq = p.unpack_u64(frames[1], "NACK seq")
                reason = bytes(frames[2]).decode("utf-8", "replace")
                item = self.unacked.pop(seq, None)
                if item is not None:
                    self.stats.nacked += 1
                    self.stats.nacked_by_reason[reason.partition(":")[0]] += 1
                    self.nack_log.append((item[0], reason))
                    log.warning("buffer rejected trajectory %s: %s", item[0], reason)
                    if self.on_nack is not None:
                        self.on_nack(item[0], reason)
            elif kind == p.RESET:
                if p.unpack_u64(frames[1], "RESET session") == self.session:
                    return self.new_session(now)
            elif kind == p.PONG:
                pass
            else:
                log.warning("sender %s: ignoring unknown message kind %r from the buffer", self.name, kind[:16])
        except (IndexError, ValueError, msgspec.DecodeError) as exc:
            log.warning("sender %s: ignoring malformed %r message from the buffer: %s", self.name, kind[:16], exc)
        return None

    # -- timers ---------------------------------------------------------------------------------
    def ping(self) -> list[bytes]:
        return [p.PING, p.pack_u64(self.session)]

    def ping_due(self, now: float) -> bool:
        if now - self.last_ping >= self.heartbeat_s:
            self.last_ping = now
            return True
        return False

    def server_dead(self, now: float) -> bool:
        """No message for `heartbeat_timeout_s` although we ping: reconnect on a fresh socket."""
        return now - self.last_recv > self.heartbeat_timeout_s

    def next_timer(self, now: float) -> float:
        """Seconds until the next ping or liveness check is due."""
        return max(0.0, min(self.last_ping + self.heartbeat_s, self.last_recv + self.heartbeat_timeout_s) - now)
