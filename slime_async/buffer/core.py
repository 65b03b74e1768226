"""The partial-off-policy buffer: groups, staleness, sampling, accounting, and its WAL.

A single-threaded state machine with no sockets: the server (`buffer.server`) feeds it, and tests
drive it directly. Each trajectory that arrives is, at every moment, in exactly one place:

    pending    its group is still incomplete
    ready      its group is complete (or was released by the group timeout) and not yet handed out
    delivered  handed to the trainer in a batch that the trainer has not yet reported trained
    applied    the trainer reported its batch trained (its step applied), but no checkpoint holds
               that step yet: a trainer that restarts from an older checkpoint gets it back
    trained    a checkpoint holds the step that trained it (the trainer reported it `committed`):
               it leaves memory, and the WAL at compaction
    dropped    with a reason: `stale` (over the staleness bound), `late` (its group had already
               been released) or `ahead` (tokens of a weight version that no trainer has reached)

so that `received == trained + pending + ready + delivered + applied + sum(dropped)` always
(`check_accounting`). A restarted trainer trains every trajectory of the steps it lost again, in
the same batches where the sampling policy allows: the run's data is trained exactly once.
A trajectory id seen before is a duplicate: acked again, counted, never stored twice.

Staleness (docs/architecture.md): trainer version minus the oldest token version of the trajectory. A group
is handed out whole or not at all, so a group is dropped when any of its trajectories is over the
bound (the group's advantage baseline needs all of its members).

Every state change goes through the WAL first (when one is given), so `Buffer.open` on the same
directory after a crash rebuilds the same state.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from slime_async.buffer import snapshot
from slime_async.buffer.policies import POLICIES, SamplingPolicy, group_max_version, group_min_version
from slime_async.buffer.snapshot import Frame
from slime_async.buffer.wal import RecordType, WriteAheadLog
from slime_async.types import Group, Trajectory, from_msgpack, to_msgpack

log = logging.getLogger(__name__)

_SETTLED_KEPT = 4096
"""Settled batch ids remembered: far more than the requests a trainer can have in flight."""

STALE = "stale"
LATE = "late"
AHEAD = "ahead"


class AccountingError(AssertionError):
    """received != trained + buffered + dropped: a trajectory went missing. Always a bug."""


@dataclass
class _Pending:
    trajectories: list[Trajectory]
    first_arrival: float


@dataclass
class Batch:
    """What the trainer gets: whole groups, the version their staleness was checked against."""

    batch_id: int
    version: int
    groups: list[Group]
    applied_at: int | None = None
    """The trainer's version after the step that trained it (None: not reported trained yet)."""

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)


@dataclass
class Counters:
    received: int = 0
    trained: int = 0
    duplicates: int = 0
    """Redeliveries of ids seen before, by this process since it started (not kept in the WAL: they
    change nothing)."""
    partial_groups: int = 0
    """Groups released by the timeout with fewer than `group_size` trajectories."""
    dropped: Counter[str] = field(default_factory=Counter)


class _Release(msgspec.Struct, array_like=True):
    group_id: str


class _Evict(msgspec.Struct, array_like=True):
    group_ids: list[str]
    reason: str


class _Deliver(msgspec.Struct, array_like=True):
    batch_id: int
    version: int
    group_ids: list[str]


class _Version(msgspec.Struct, array_like=True):
    version: int
    trained: list[int]
    restarted: bool
    returned: list[int] = []
    committed: int | None = None


class Buffer:
    """Groups trajectories, drops stale ones, hands batches to the trainer, logs it all."""

    def __init__(
        self,
        group_size: int,
        max_staleness: int,
        *,
        policy: str | SamplingPolicy = "fifo",
        group_timeout_s: float | None = None,
        wal: WriteAheadLog | None = None,
        compact_every: int = 4096,
    ) -> None:
        if group_size < 1 or max_staleness < 0:
            raise ValueError(f"group_size must be >= 1 and max_staleness >= 0, got {group_size}, {max_staleness}")
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"buffer.policy: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
            policy = POLICIES[policy]
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.policy: SamplingPolicy = policy
        self.group_timeout_s = group_timeout_s
        self.compact_every = compact_every
        self.wal = wal
        self.version = 0
        self.counters = Counters()
        self._seen: set[str] = set()
        self._released: set[str] = set()
        """Groups already released to ready; a member arriving after that is dropped as `late`."""
        self._pending: dict[str, _Pending] = {}
        self._ready: OrderedDict[str, Group] = OrderedDict()
        self._delivered: dict[int, Batch] = {}
        self._settled: OrderedDict[int, None] = OrderedDict()
        """The latest batch ids reported trained or returned. The trainer's client resends a GET until
        it is answered, so a resend can arrive after its batch was trained: it must not be handed a
        new batch under the old id, which nobody would ever train (trajectories lost in `delivered`)."""
        self._min_version: dict[str, int | None] = {}
        """Oldest token version of each ready or delivered group, computed once at release (hot path)."""
        self._max_version: dict[str, int | None] = {}
        """Newest token version of each ready or delivered group (see `_is_ahead`)."""
        self.high_water = 0
        """The highest version the trainer has reported, across its restarts."""
        self._frames: dict[str, Frame] = {}
        """The wire frame of each trajectory held (pending, ready, delivered), kept as it arrived: the
        trainer's batches and the compaction snapshot send and write it without re-encoding."""
        self._frame_bytes = 0
        """Total size of `_frames`: what a compaction would write."""
        self._n = Counter[str]()
        """Trajectories in each place (pending, ready, delivered), kept as they move: metrics are O(1)."""
        self._trained_since_compaction = 0
        self._ready_floor: int | None = None
        """Oldest token version among ready groups (None: unknown, scan); lowered as groups arrive."""
        self._ahead_possible = False
        """A group newer than the trainer may be ready (set as groups arrive, cleared by a scan)."""
        self._replaying = False

    # -- construction from disk ------------------------------------------------------------------
    @classmethod
    def open(
        cls, wal_dir: str | Path, group_size: int, max_staleness: int, *, fsync: bool = False, **kwargs: object
    ) -> Buffer:
        """A buffer whose state is whatever the WAL in `wal_dir` says (empty if there is none)."""
        wal = WriteAheadLog(wal_dir, fsync=fsync)
        buf = cls(group_size, max_staleness, wal=wal, **kwargs)  # type: ignore[arg-type]
        buf._replaying = True
        try:
            n = 0
            for rtype, payload in wal.replay():
                buf._apply(rtype, payload)
                n += 1
        finally:
            buf._replaying = False
        if n:
            log.info("buffer: replayed %d WAL records from %s: %s", n, wal.path, buf.metrics())
        buf.check_accounting()
        return buf

    def _apply(self, rtype: RecordType, payload: bytes) -> None:
        if rtype == RecordType.TRAJECTORY:
            self.add(from_msgpack(payload, Trajectory), payload)
        elif rtype == RecordType.RELEASE:
            self._release(msgspec.msgpack.decode(payload, type=_Release).group_id, partial=True)
        elif rtype == RecordType.EVICT:
            e = msgspec.msgpack.decode(payload, type=_Evict)
            self._evict(e.group_ids, e.reason)
        elif rtype == RecordType.DELIVER:
            d = msgspec.msgpack.decode(payload, type=_Deliver)
            self._deliver(d.batch_id, d.version, d.group_ids)
        elif rtype == RecordType.VERSION:
            v = msgspec.msgpack.decode(payload, type=_Version)
            self.set_version(v.version, trained=v.trained, restarted=v.restarted, returned=v.returned,
                             committed=v.committed)
        elif rtype == RecordType.SNAPSHOT_FRAMES:
            self._load_snapshot(snapshot.decode(payload))
        elif rtype == RecordType.SNAPSHOT:
            self._load_snapshot(snapshot.decode_v1(payload))

    def _log(self, rtype: RecordType, payload: bytes | memoryview) -> None:
        if self.wal is not None and not self._replaying:
            self.wal.append(rtype, payload)

    # -- input -----------------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, frame: bytes | memoryview | None = None, now: float | None = None) -> bool:
        """Take one trajectory (with its wire frame, for the WAL). False if it is a duplicate."""
        if trajectory.id in self._seen:
            self.counters.duplicates += 1
            return False
        if frame is None and self.wal is not None:
            frame = to_msgpack(trajectory)
        if frame is not None:
            self._log(RecordType.TRAJECTORY, frame)
        self._seen.add(trajectory.id)
        self.counters.received += 1
        gid = trajectory.group_id
        if gid in self._released:
            self._drop([trajectory], LATE)
            return True
        if frame is not None:
            self._frames[trajectory.id] = frame
            self._frame_bytes += len(frame)
        pending = self._pending.get(gid)
        if pending is None:
            pending = self._pending[gid] = _Pending([], time.monotonic() if now is None else now)
        pending.trajectories.append(trajectory)
        self._n["pending"] += 1
        if len(pending.trajectories) >= self.group_size:
            self._release(gid, partial=False)
        return True

    def tick(self, now: float | None = None) -> int:
        """Release incomplete groups older than the group timeout; returns how many."""
        if self.group_timeout_s is None:
            return 0
        now = time.monotonic() if now is None else now
        expired = [gid for gid, p in self._pending.items() if now - p.first_arrival >= self.group_timeout_s]
        for gid in expired:
            self._log(RecordType.RELEASE, msgspec.msgpack.encode(_Release(gid)))
            self._release(gid, partial=True)
        return len(expired)

    def next_timeout(self, now: float | None = None) -> float | None:
        """Seconds until the oldest pending group times out (None when nothing can time out)."""
        if self.group_timeout_s is None or not self._pending:
            return None
        now = time.monotonic() if now is None else now
        oldest = min(p.first_arrival for p in self._pending.values())
        return max(0.0, oldest + self.group_timeout_s - now)

    def _release(self, gid: str, partial: bool) -> None:
        pending = self._pending.pop(gid, None)
        if pending is None:
            return
        self._released.add(gid)
        trajs = sorted(pending.trajectories, key=lambda t: t.sample_index)
        self._n["pending"] -= len(trajs)
        if partial:
            self.counters.partial_groups += 1
        group = Group(group_id=gid, task_id=trajs[0].task_id, trajectories=trajs)
        self._min_version[gid] = group_min_version(group)
        self._max_version[gid] = group_max_version(group)
        if self._is_stale(group):
            self._drop(trajs, STALE)
            del self._min_version[gid], self._max_version[gid]
        else:
            self._ready[gid] = group
            self._n["ready"] += len(trajs)
            newest = self._max_version[gid]
            self._ahead_possible |= newest is not None and newest > self.high_water
            v = self._min_version[gid]
            if self._ready_floor is not None and v is not None:
                self._ready_floor = min(self._ready_floor, v)

    # -- staleness -------------------------------------------------------------------------------
    def _is_stale(self, group: Group) -> bool:
        oldest = self._min_version[group.group_id]
        return oldest is not None and self.version - oldest > self.max_staleness

    def _evict_stale(self, log_ahead: bool = False) -> None:
        """Drop ready groups over the staleness bound; with `log_ahead` (a batch is being asked for,
        the trainer's version is known) also those ahead of every version reached, logged as such
        (staleness depends only on the version, which the WAL has; being ahead is of that moment)."""
        floor = self.version - self.max_staleness  # stale: oldest version below this
        ahead_check = log_ahead and self._ahead_possible
        if self._ready_floor is not None and self._ready_floor >= floor and not ahead_check:
            return  # nothing ready is that old: skip the scan (get_batch calls this on every request)
        self._evict([gid for gid, g in self._ready.items() if self._is_stale(g)], STALE)
        if ahead_check:
            ahead = [gid for gid in self._ready if self._is_ahead(gid)]
            if ahead:
                self._log(RecordType.EVICT, msgspec.msgpack.encode(_Evict(ahead, AHEAD)))
                self._evict(ahead, AHEAD)
            self._ahead_possible = False
        versions = [v for gid in self._ready if (v := self._min_version[gid]) is not None]
        self._ready_floor = min(versions, default=sys.maxsize)

    def _evict(self, group_ids: list[str], reason: str) -> None:
        for gid in group_ids:
            group = self._ready.pop(gid)
            del self._min_version[gid], self._max_version[gid]
            self._n["ready"] -= len(group.trajectories)
            self._drop(group.trajectories, reason)

    def _is_ahead(self, gid: str) -> bool:
        """Tokens of a version that no trainer has reached (junk: it would never go stale). Checked
        when batches are handed out, once the trainer has told its version: the engines hear of a
        new version before the buffer does, so an arriving group may be a step ahead, legitimately.
        Versions a restarted trainer rolled back were reached: their tokens are ordinary off-policy
        data (true behaviour logprobs), staleness-checked like any."""
        newest = self._max_version[gid]
        return newest is not None and newest > self.high_water

    def _drop(self, trajs: list[Trajectory], reason: str) -> None:
        self.counters.dropped[reason] += len(trajs)
        self._forget_frames(trajs)
        if not self._replaying:
            log.info("buffer: dropped %d trajectories (%s) of group %s", len(trajs), reason, trajs[0].group_id)

    # -- trainer side ----------------------------------------------------------------------------
    def ready_trajectories(self) -> int:
        return self._n["ready"]

    def get_batch(self, num_trajectories: int, batch_id: int) -> Batch | None:
        """Hand out whole ready groups, at least `num_trajectories` trajectories in all (overshooting
        by less than one group), or None if not enough are ready. The same `batch_id` asked again
        returns the same batch: a retried request never gets a second one."""
        if num_trajectories < 1:
            raise ValueError(f"get_batch: num_trajectories must be >= 1, got {num_trajectories}")
        if batch_id in self._delivered:
            return self._delivered[batch_id]
        if batch_id in self._settled:
            return None  # a late resend of a request already answered and settled: nothing more for it
        self._evict_stale(log_ahead=True)
        if self.ready_trajectories() < num_trajectories:
            return None
        chosen: list[str] = []
        total = 0
        for group in self.policy(list(self._ready.values()), self.version):
            if total >= num_trajectories:
                break
            if group.group_id in self._ready and group.group_id not in chosen:
                chosen.append(group.group_id)
                total += len(group.trajectories)
        if total < num_trajectories:
            return None  # the policy held groups back
        self._log(RecordType.DELIVER, msgspec.msgpack.encode(_Deliver(batch_id, self.version, chosen)))
        return self._deliver(batch_id, self.version, chosen)

    def _forget_frames(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            frame = self._frames.pop(t.id, None)
            if frame is not None:
                self._frame_bytes -= len(frame)

    def frames_of(self, batch: Batch) -> list[Frame]:
        """The wire frames of a batch's trajectories, group after group, as they arrived."""
        out: list[Frame] = []
        for g in batch.groups:
            for t in g.trajectories:
                frame = self._frames.get(t.id)
                out.append(to_msgpack(t) if frame is None else frame)  # added in-process, without a frame
        return out

    def _deliver(self, batch_id: int, version: int, group_ids: list[str]) -> Batch:
        batch = Batch(batch_id, version, [self._ready.pop(gid) for gid in group_ids])
        self._delivered[batch_id] = batch
        self._n["ready"] -= batch.num_trajectories
        self._n["delivered"] += batch.num_trajectories
        return batch

    def set_version(
        self,
        version: int,
        trained: list[int] | tuple[int, ...] = (),
        restarted: bool = False,
        returned: list[int] | tuple[int, ...] = (),
        committed: int | None = None,
    ) -> None:
        """The trainer is now at `version` and has trained the batches `trained` (their steps applied).

        `committed`: a checkpoint holds every step up to this version, so the batches applied up to
        it are trained for good. Batches in `returned` (handed out, never trained) go back to the
        front of the ready queue. With `restarted` the trainer came back from the checkpoint at
        `version`: what it applied up to `version` is committed, and every other batch it was handed
        (applied after that checkpoint, or never reported) goes back to the front, in the order it
        was trained. Either way they are checked for staleness again.
        """
        record = _Version(version, list(trained), restarted, list(returned), committed)
        self._log(RecordType.VERSION, msgspec.msgpack.encode(record))
        self._settle([*trained, *returned])
        applied_at = self.version if restarted else version  # a restart reports no new step
        for batch_id in trained:
            batch = self._delivered.get(batch_id)
            if batch is not None and batch.applied_at is None:
                batch.applied_at = applied_at
                self._n["delivered"] -= batch.num_trajectories
                self._n["applied"] += batch.num_trajectories
        if restarted:
            committed = version if committed is None else min(committed, version)
        if committed is not None:
            done = [b for b in self._delivered.values() if b.applied_at is not None and b.applied_at <= committed]
            for batch in done:
                del self._delivered[batch.batch_id]
                self._n["applied"] -= batch.num_trajectories
                for g in batch.groups:
                    self._min_version.pop(g.group_id, None)
                    self._max_version.pop(g.group_id, None)
                    self._forget_frames(g.trajectories)
                self.counters.trained += batch.num_trajectories
                self._trained_since_compaction += batch.num_trajectories
        if restarted:  # applied after the checkpoint, then never reported: trained again, in that order
            going_back = sorted(self._delivered.values(), key=lambda b: (b.applied_at is None, b.applied_at or 0))
        else:
            going_back = [self._delivered[b] for b in returned if b in self._delivered]
        if going_back:
            back = [g for b in going_back for g in self._delivered.pop(b.batch_id).groups]
            rest = list(self._ready.items())
            self._ready = OrderedDict([(g.group_id, g) for g in back] + rest)
            for b in going_back:
                self._n["delivered" if b.applied_at is None else "applied"] -= b.num_trajectories
            self._n["ready"] += sum(b.num_trajectories for b in going_back)
            self._ready_floor = None
            self._ahead_possible = True
        self.version = version
        self.high_water = max(self.high_water, version)
        self._evict_stale()
        if self._compaction_due():
            self.compact()

    def is_settled(self, batch_id: int) -> bool:
        """Whether `batch_id` was handed out and then reported trained or returned (among the latest)."""
        return batch_id in self._settled

    def _settle(self, batch_ids: list[int] | tuple[int, ...]) -> None:
        for b in batch_ids:
            self._settled[b] = None
        while len(self._settled) > _SETTLED_KEPT:
            self._settled.popitem(last=False)

    def _compaction_due(self) -> bool:
        """After `compact_every` trained, and once the live part is at most a quarter of the log.

        Compaction writes everything live; when the trainer lags, that is up to `capacity` frames,
        and rewriting them every `compact_every` trained would write more than the traffic itself.
        Waiting until 3/4 of the log is dead keeps the extra writing under 1/3 of the traffic, and
        the log under about 4x what is live (plus `compact_every` trajectories)."""
        if self._replaying or self.wal is None or self._trained_since_compaction < self.compact_every:
            return False
        return self._frame_bytes * 4 <= self.wal.size_bytes

    # -- persistence -----------------------------------------------------------------------------
    def compact(self) -> None:
        """Rewrite the WAL as one snapshot of what is live; trained trajectories leave the disk."""
        if self.wal is None:
            return
        c = self.counters
        state = snapshot.SnapshotState(
            version=self.version, received=c.received, trained=c.trained,
            partial_groups=c.partial_groups, dropped=dict(c.dropped), seen=list(self._seen),
            released=list(self._released), pending=[p.trajectories for p in self._pending.values()],
            ready=list(self._ready.values()),
            delivered=[(b.batch_id, b.version, b.groups, b.applied_at) for b in self._delivered.values()],
            frames=self._frames,
            settled=list(self._settled), high_water=self.high_water,
        )
        before = self.wal.size_bytes
        self.wal.rewrite([(RecordType.SNAPSHOT_FRAMES, snapshot.encode(state))])
        self._trained_since_compaction = 0
        log.info("buffer: compacted the WAL from %d to %d bytes", before, self.wal.size_bytes)

    def _load_snapshot(self, snap: snapshot.SnapshotState) -> None:
        self.version = snap.version
        self.high_water = max(snap.high_water, snap.version)
        self.counters = Counters(
            snap.received, snap.trained, self.counters.duplicates, snap.partial_groups, Counter(snap.dropped)
        )
        self._seen = set(snap.seen)
        self._released = set(snap.released)
        now = time.monotonic()  # pending groups restart their timeout: the old clock means nothing here
        self._pending = {ts[0].group_id: _Pending(ts, now) for ts in snap.pending if ts}
        self._ready = OrderedDict((g.group_id, g) for g in snap.ready)
        self._delivered = {d[0]: Batch(d[0], d[1], d[2], d[3] if len(d) > 3 else None) for d in snap.delivered}
        self._settled = OrderedDict.fromkeys(snap.settled)
        groups = [*self._ready.values(), *(g for b in self._delivered.values() for g in b.groups)]
        self._min_version = {g.group_id: group_min_version(g) for g in groups}
        self._max_version = {g.group_id: group_max_version(g) for g in groups}
        self._n = Counter(
            pending=sum(len(p.trajectories) for p in self._pending.values()),
            ready=sum(len(g.trajectories) for g in self._ready.values()),
            delivered=sum(b.num_trajectories for b in self._delivered.values() if b.applied_at is None),
            applied=sum(b.num_trajectories for b in self._delivered.values() if b.applied_at is not None),
        )
        self._frames = dict(snap.frames)
        self._frame_bytes = sum(len(f) for f in self._frames.values())
        self._ready_floor = None
        self._ahead_possible = True

    def commit(self) -> None:
        """Make every state change so far durable; call before acking or replying."""
        if self.wal is not None:
            self.wal.commit()

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()

    # -- accounting ------------------------------------------------------------------------------
    @property
    def stored(self) -> int:
        """Trajectories held and not yet handed out (pending + ready): what `capacity` bounds."""
        return self._n["pending"] + self._n["ready"]

    def metrics(self) -> dict[str, int]:
        """Counters and gauges; `received == trained + pending + ready + delivered + applied + dropped_total`
        (`buffered` is the four in the middle)."""
        c = self.counters
        out = {
            "version": self.version,
            "received": c.received,
            "trained": c.trained,
            "pending": self._n["pending"],
            "ready": self._n["ready"],
            "delivered": self._n["delivered"],
            "applied": self._n["applied"],
            "dropped_total": sum(c.dropped.values()),
            "duplicates": c.duplicates,
            "partial_groups": c.partial_groups,
            "ready_groups": len(self._ready),
        }
        out["buffered"] = out["pending"] + out["ready"] + out["delivered"] + out["applied"]
        for reason in (STALE, LATE, AHEAD):
            out[f"dropped_{reason}"] = c.dropped.get(reason, 0)
        return out

    def check_accounting(self) -> None:
        """Raise AccountingError if any received trajectory is unaccounted for."""
        m = self.metrics()
        if m["received"] != m["trained"] + m["buffered"] + m["dropped_total"]:
            raise AccountingError(f"buffer accounting broken: {m}")
        counted = (
            sum(len(p.trajectories) for p in self._pending.values()),
            sum(len(g.trajectories) for g in self._ready.values()),
            sum(b.num_trajectories for b in self._delivered.values() if b.applied_at is None),
            sum(b.num_trajectories for b in self._delivered.values() if b.applied_at is not None),
        )
        if counted != (m["pending"], m["ready"], m["delivered"], m["applied"]):
            raise AccountingError(f"buffer gauges disagree with its contents {counted}: {m}")
