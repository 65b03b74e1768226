"""The buffer's compaction snapshot: everything live, as one WAL record, without re-encoding.

A snapshot holds the counters, the ids seen, and every live trajectory (pending, ready, delivered).
The trajectories are written as the wire frames the buffer already holds, one after another behind
a small header that says how they form groups: compaction is then a few large writes, not a
re-encoding of every array (that cost more than the traffic itself at ~50 kB a trajectory).

Payload of a `SNAPSHOT_FRAMES` record: u32 header length, the `_Header` (msgpack), the frames.
`SNAPSHOT` records (the older form: one msgpack document) are still read, never written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgspec

from slime_async.types import Group, Trajectory, from_msgpack, to_msgpack

Frame = bytes | memoryview
_U32 = struct.Struct("<I")


@dataclass
class SnapshotState:
    """What a snapshot restores; `frames` maps trajectory ids to their wire frames."""

    version: int
    received: int
    trained: int
    partial_groups: int
    dropped: dict[str, int]
    seen: list[str]
    released: list[str]
    pending: list[list[Trajectory]]
    ready: list[Group]
    delivered: list[tuple[int, int, list[Group], int | None]]
    """(batch id, version handed out at, groups, version after the step that trained it or None)."""
    frames: dict[str, Frame]
    settled: list[int] = field(default_factory=list)
    """The latest batch ids reported trained or returned (see `Buffer.is_settled`)."""
    high_water: int = 0
    """The highest version the trainer reported (see `Buffer.high_water`)."""


class _GroupHeader(msgspec.Struct, array_like=True):
    group_id: str
    task_id: str
    sizes: list[int]
    """Byte size of each member's frame, in the order the frames follow."""


class _Header(msgspec.Struct, kw_only=True):
    version: int
    received: int
    trained: int
    partial_groups: int
    dropped: dict[str, int]
    seen: list[str]
    released: list[str]
    pending: list[_GroupHeader]
    ready: list[_GroupHeader]
    delivered: list[tuple[int, int, list[_GroupHeader]]]
    settled: list[int] = []
    applied_at: list[int | None] = []
    """Per delivered batch, in order (older snapshots: none, all unapplied)."""
    high_water: int = 0


class _SnapshotV1(msgspec.Struct, kw_only=True):
    """The older snapshot record (`RecordType.SNAPSHOT`): trajectories re-encoded inside it."""

    version: int
    received: int
    trained: int
    partial_groups: int
    dropped: dict[str, int]
    seen: list[str]
    released: list[str]
    pending: list[list[Trajectory]]
    ready: list[Group]
    delivered: list[tuple[int, int, list[Group]]]


def encode(state: SnapshotState) -> list[Frame]:
    """The record's payload as buffers to write one after another (frames are not copied)."""
    frames: list[Frame] = []

    def header(group_id: str, task_id: str, trajs: list[Trajectory]) -> _GroupHeader:
        mine = [state.frames[t.id] for t in trajs]
        frames.extend(mine)
        return _GroupHeader(group_id, task_id, [len(f) for f in mine])

    head = _Header(
        version=state.version, received=state.received, trained=state.trained,
        partial_groups=state.partial_groups, dropped=state.dropped, seen=state.seen, released=state.released,
        pending=[header(ts[0].group_id, ts[0].task_id, ts) for ts in state.pending if ts],
        ready=[header(g.group_id, g.task_id, g.trajectories) for g in state.ready],
        delivered=[(d[0], d[1], [header(g.group_id, g.task_id, g.trajectories) for g in d[2]])
                   for d in state.delivered],
        settled=state.settled, applied_at=[d[3] for d in state.delivered], high_water=state.high_water,
    )
    head_bytes = msgspec.msgpack.encode(head)
    return [_U32.pack(len(head_bytes)), head_bytes, *frames]


def decode(payload: bytes) -> SnapshotState:
    """Read a `SNAPSHOT_FRAMES` payload; trajectories are views of `payload` (no copy)."""
    (n,) = _U32.unpack_from(payload, 0)
    head = msgspec.msgpack.decode(memoryview(payload)[_U32.size : _U32.size + n], type=_Header)
    view = memoryview(payload)
    offset = _U32.size + n
    frames: dict[str, Frame] = {}

    def group(g: _GroupHeader) -> Group:
        nonlocal offset
        trajs = []
        for size in g.sizes:
            frame = view[offset : offset + size]
            offset += size
            t = from_msgpack(frame, Trajectory)
            frames[t.id] = frame
            trajs.append(t)
        return Group(group_id=g.group_id, task_id=g.task_id, trajectories=trajs)

    pending = [group(g).trajectories for g in head.pending]
    ready = [group(g) for g in head.ready]
    applied = head.applied_at or [None] * len(head.delivered)
    delivered = [(b, v, [group(g) for g in gs], a) for (b, v, gs), a in zip(head.delivered, applied, strict=True)]
    if offset != len(payload):
        raise ValueError(f"snapshot: {len(payload) - offset} bytes left after the last frame")
    return SnapshotState(
        head.version, head.received, head.trained, head.partial_groups, head.dropped, head.seen, head.released,
        pending, ready, delivered, frames, head.settled, head.high_water,
    )


def decode_v1(payload: bytes) -> SnapshotState:
    """Read an older `SNAPSHOT` record (its trajectories are encoded again to get their frames)."""
    s = from_msgpack(payload, _SnapshotV1)
    groups = [*s.ready, *(g for _, _, gs in s.delivered for g in gs)]
    trajs = [*(t for ts in s.pending for t in ts), *(t for g in groups for t in g.trajectories)]
    return SnapshotState(
        s.version, s.received, s.trained, s.partial_groups, s.dropped, s.seen, s.released,
        s.pending, s.ready, [(b, v, gs, None) for b, v, gs in s.delivered], {t.id: to_msgpack(t) for t in trajs},
    )
