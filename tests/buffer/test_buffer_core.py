"""The buffer's rules, driven directly: groups, timeouts, staleness, policies, restarts, the WAL."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from slime_async.buffer import Buffer, WALCorruptError, freshest
from slime_async.buffer.wal import WAL_FILE
from slime_async.types import Group, StopReason, Trajectory, Turn, from_msgpack


def traj(group: str, index: int, version: int = 0, tokens: int = 6, tid: str | None = None) -> Trajectory:
    return Trajectory(
        id=tid or f"{group}-{index}", task_id=f"task-{group}", group_id=group, sample_index=index,
        stop_reason=StopReason.DONE,
        turns=[Turn(prompt_ids=np.arange(3), completion_ids=np.arange(tokens), logprobs=np.zeros(tokens, np.float32),
                    versions=np.full(tokens, version))],
    )


def fill(buf: Buffer, group: str, n: int, version: int = 0, now: float = 0.0) -> None:
    for i in range(n):
        buf.add(traj(group, i, version), now=now)


def ids(batch) -> list[str]:
    return [t.id for g in batch.groups for t in g.trajectories]


def balanced(buf: Buffer) -> dict[str, int]:
    m = buf.metrics()
    buf.check_accounting()
    return m


def test_groups_are_released_only_when_complete() -> None:
    buf = Buffer(group_size=3, max_staleness=5)
    fill(buf, "a", 2)
    fill(buf, "b", 3)
    assert buf.get_batch(4, batch_id=1) is None  # "a" is incomplete, so only 3 are ready
    fill(buf, "a", 3)  # a-0 and a-1 again: duplicates; a-2 completes the group
    batch = buf.get_batch(4, batch_id=2)
    assert batch is not None and ids(batch) == ["b-0", "b-1", "b-2", "a-0", "a-1", "a-2"]  # whole groups, FIFO
    m = balanced(buf)
    assert (m["received"], m["duplicates"], m["delivered"], m["pending"]) == (6, 2, 6, 0)


def test_group_timeout_releases_a_smaller_group_and_late_members_are_dropped() -> None:
    buf = Buffer(group_size=4, max_staleness=5, group_timeout_s=10.0)
    fill(buf, "a", 2, now=100.0)
    assert buf.tick(now=109.0) == 0 and buf.next_timeout(now=109.0) == pytest.approx(1.0)
    assert buf.tick(now=110.0) == 1
    batch = buf.get_batch(2, batch_id=1)
    assert batch is not None and ids(batch) == ["a-0", "a-1"]
    buf.add(traj("a", 2), now=111.0)  # its group has gone: counted, not kept, not lost
    m = balanced(buf)
    assert (m["partial_groups"], m["dropped_late"], m["received"]) == (1, 1, 3)


def test_staleness_bound_is_never_exceeded_and_drops_are_counted() -> None:
    buf = Buffer(group_size=2, max_staleness=2)
    fill(buf, "old", 2, version=0)
    fill(buf, "mixed", 1, version=3)
    buf.add(traj("mixed", 1, version=1))
    fill(buf, "new", 2, version=3)
    buf.set_version(3)  # old: 3 - 0 > 2 dropped; mixed: 3 - 1 = 2 kept
    batch = buf.get_batch(4, batch_id=1)
    assert batch is not None and ids(batch) == ["mixed-0", "mixed-1", "new-0", "new-1"]
    assert all(batch.version - t.min_version() <= 2 for g in batch.groups for t in g.trajectories)
    fill(buf, "late-old", 2, version=0)  # stale on arrival (checked when its group is released)
    m = balanced(buf)
    assert m["dropped_stale"] == 4 and m["ready"] == 0


def test_stale_groups_are_evicted_when_the_version_moves_while_they_wait() -> None:
    buf = Buffer(group_size=1, max_staleness=1)
    fill(buf, "g", 1, version=0)
    buf.set_version(1)
    assert buf.metrics()["ready"] == 1
    buf.set_version(2)
    m = balanced(buf)
    assert (m["ready"], m["dropped_stale"]) == (0, 1)
    assert buf.get_batch(1, batch_id=1) is None


def test_freshest_and_custom_policies() -> None:
    buf = Buffer(group_size=1, max_staleness=10, policy=freshest)
    for name, version in [("v1", 1), ("v3", 3), ("v2", 2)]:
        buf.add(traj(name, 0, version))
    buf.set_version(3)
    batch = buf.get_batch(2, batch_id=1)
    assert batch is not None and ids(batch) == ["v3-0", "v2-0"]

    def highest_reward_first(groups: Sequence[Group], trainer_version: int) -> Sequence[Group]:
        return sorted(groups, key=lambda g: -max(g.rewards))

    buf = Buffer(group_size=1, max_staleness=10, policy=highest_reward_first)
    for k, reward in enumerate([0.1, 0.9, 0.5]):
        t = traj(f"r{k}", 0)
        t.reward = reward
        buf.add(t)
    batch = buf.get_batch(1, batch_id=7)
    assert batch is not None and ids(batch) == ["r1-0"]
    assert buf.get_batch(1, batch_id=7) is batch  # the same request id never gets a second batch
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        Buffer(group_size=1, max_staleness=1, policy="lifo")


def test_trained_batches_leave_and_a_restarted_trainer_gets_untrained_ones_back() -> None:
    buf = Buffer(group_size=1, max_staleness=10)
    for k in range(4):
        buf.add(traj(f"g{k}", 0))
    b1, b2 = buf.get_batch(1, batch_id=1), buf.get_batch(1, batch_id=2)
    assert b1 is not None and b2 is not None
    buf.set_version(1, trained=[1], committed=1)
    m = balanced(buf)
    assert (m["trained"], m["delivered"], m["ready"]) == (1, 1, 2)
    buf.set_version(1, restarted=True)  # batch 2 was handed out but never trained
    again = buf.get_batch(1, batch_id=3)
    assert again is not None and ids(again) == ids(b2)
    assert balanced(buf)["trained"] == 1
    buf.set_version(1, returned=[3])  # reached the client too late to be trained: handed back
    assert ids(buf.get_batch(1, batch_id=4)) == ids(b2)
    assert balanced(buf)["delivered"] == 1


@pytest.mark.parametrize("restart", ["none", "replay", "snapshot"])
def test_a_settled_batch_id_asked_again_takes_nothing(tmp_path: Path, restart: str) -> None:
    # The trainer's client resends a GET until answered; a resend that crosses its answer arrives
    # after the batch was trained. Handing it a new batch under that id would strand the groups in
    # `delivered`, since nobody waits for it (CI once lost 40 of 360 trajectories that way).
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=10, compact_every=1)
    for k in range(4):
        buf.add(traj(f"g{k}", 0))
    assert buf.get_batch(1, batch_id=7) is not None and buf.get_batch(1, batch_id=8) is not None
    buf.set_version(1, trained=[7], returned=[8], committed=1)
    if restart == "snapshot":
        buf.compact()
    if restart != "none":
        buf.close()
        buf = Buffer.open(tmp_path, group_size=1, max_staleness=10)
    assert buf.is_settled(7) and buf.is_settled(8) and not buf.is_settled(9)
    assert buf.get_batch(1, batch_id=7) is None and buf.get_batch(1, batch_id=8) is None
    m = balanced(buf)
    assert (m["ready"], m["delivered"], m["trained"]) == (3, 0, 1), m
    buf.close()


def test_wal_restores_everything_acked_and_not_trained(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=2, max_staleness=3, group_timeout_s=5.0)
    fill(buf, "a", 2, version=1)
    fill(buf, "b", 2, version=1)
    fill(buf, "c", 1, version=1, now=0.0)
    fill(buf, "d", 1, version=1)
    buf.tick(now=10.0)  # c and d released as partial groups (logged: replay must not re-decide)
    buf.set_version(1)
    first = buf.get_batch(2, batch_id=11)
    second = buf.get_batch(2, batch_id=12)
    buf.set_version(2, trained=[11], committed=2)
    buf.commit()
    before = balanced(buf)
    buf.close()

    back = Buffer.open(tmp_path, group_size=2, max_staleness=3)
    assert balanced(back) == before
    assert back.get_batch(2, batch_id=12) is not None and ids(back.get_batch(2, batch_id=12)) == ids(second)
    assert ids(first) == ["a-0", "a-1"]
    back.add(traj("a", 0, version=1))  # seen before the restart: still a duplicate
    assert back.metrics()["duplicates"] == 1
    back.set_version(3, trained=[12], committed=3)
    rest = back.get_batch(2, batch_id=13)
    assert rest is not None and sorted(ids(rest)) == ["c-0", "d-0"]
    back.close()


def test_compaction_keeps_state_and_shrinks_the_log(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=100, compact_every=50)
    for k in range(60):
        buf.add(traj(f"g{k}", 0, tokens=500))
    for k in range(50):
        assert buf.get_batch(1, batch_id=k) is not None
    buf.commit()
    size_before = (tmp_path / WAL_FILE).stat().st_size
    buf.set_version(1, trained=list(range(50)), committed=1)  # reaches compact_every: the log is rewritten
    buf.commit()
    assert (tmp_path / WAL_FILE).stat().st_size < size_before / 3
    buf.add(traj("g0", 0))  # ids survive compaction: still a duplicate
    buf.add(traj("after", 0))
    buf.close()
    back = Buffer.open(tmp_path, group_size=1, max_staleness=100)
    m = balanced(back)
    assert (m["received"], m["trained"], m["ready"], m["duplicates"]) == (61, 50, 11, 0)
    back.add(traj("g0", 0))
    assert back.metrics()["duplicates"] == 1 and back.metrics()["received"] == 61


def test_compaction_waits_until_most_of_the_log_is_dead(tmp_path: Path) -> None:
    # A lagging trainer: most of what was received is still live, so a rewrite would copy it all.
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=100, compact_every=10)
    for k in range(40):
        buf.add(traj(f"g{k}", 0, tokens=500))
    for k in range(20):
        assert buf.get_batch(1, batch_id=k) is not None
    buf.set_version(1, trained=list(range(10)), committed=1)  # 30 of 40 live: no rewrite
    buf.commit()
    size = (tmp_path / WAL_FILE).stat().st_size
    buf.set_version(2, trained=list(range(10, 20)), committed=2)  # 20 of 40 live: still none
    buf.commit()
    assert (tmp_path / WAL_FILE).stat().st_size > size  # only appended to
    for k in range(20, 32):
        assert buf.get_batch(1, batch_id=k) is not None
    buf.set_version(3, trained=list(range(20, 32)), committed=3)  # 8 of 40 live (< 1/4): rewritten
    buf.commit()
    assert (tmp_path / WAL_FILE).stat().st_size < size / 3
    buf.close()
    assert balanced(Buffer.open(tmp_path, group_size=1, max_staleness=100))["ready"] == 8


def test_snapshot_restores_pending_ready_and_delivered_groups_with_their_frames(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=2, max_staleness=100, compact_every=1)
    for g in ("a", "b", "c", "d"):
        fill(buf, g, 2)
    buf.add(traj("e", 0))  # pending: its group is incomplete
    first = buf.get_batch(2, batch_id=1)
    second = buf.get_batch(2, batch_id=2)
    assert first is not None and second is not None
    buf.set_version(1, trained=[1], committed=1)  # 2 trained of 9: the rewrite keeps the other 7
    buf.compact()
    buf.close()
    back = Buffer.open(tmp_path, group_size=2, max_staleness=100)
    m = balanced(back)
    assert (m["pending"], m["ready"], m["delivered"], m["trained"]) == (1, 4, 2, 2), m
    assert ids(back.get_batch(2, batch_id=2)) == ids(second)  # the delivered batch, as it was
    frames = back.frames_of(back.get_batch(2, batch_id=2))
    assert [t.id for t in (from_msgpack(f, Trajectory) for f in frames)] == ids(second)
    back.add(traj("e", 1))  # the pending group completes after the restart
    assert back.metrics()["ready"] == 6
    back.close()


def test_torn_tail_is_cut_and_damage_is_an_error(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=1)
    for k in range(3):
        buf.add(traj(f"g{k}", 0))
    buf.close()
    path = tmp_path / WAL_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the process died in the middle of the last record
    back = Buffer.open(tmp_path, group_size=1, max_staleness=1)
    assert balanced(back)["received"] == 2
    back.add(traj("g2", 0))  # the cut record was never acked, so its sender resends it
    back.close()
    assert balanced(Buffer.open(tmp_path, group_size=1, max_staleness=1))["received"] == 3
    assert_damage_is_caught(path)


def assert_damage_is_caught(path: Path) -> None:
    """A flipped byte inside the first record's payload is an error naming the offset and the fix."""
    damaged = bytearray(path.read_bytes())
    damaged[20] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(WALCorruptError, match=r"damaged record at byte 0.*move the file aside"):
        Buffer.open(path.parent, group_size=1, max_staleness=1)


def test_a_wal_written_with_crc32_checksums_still_replays(tmp_path: Path) -> None:
    # Files written before the XXH3 checksum carry crc32 and a plain type byte: they must replay,
    # and damage in them must still be caught.
    import zlib

    from slime_async.buffer.wal import _HEADER, RecordType
    from slime_async.types import to_msgpack

    frames = [to_msgpack(traj(f"g{k}", 0)) for k in range(3)]
    path = tmp_path / WAL_FILE
    path.write_bytes(b"".join(_HEADER.pack(len(f), zlib.crc32(f), RecordType.TRAJECTORY) + f for f in frames))
    back = Buffer.open(tmp_path, group_size=1, max_staleness=1)
    assert balanced(back)["ready"] == 3
    assert back.frames_of(back.get_batch(3, batch_id=1)) == frames
    back.close()
    assert_damage_is_caught(path)


def test_new_records_carry_the_xxh3_checksum(tmp_path: Path) -> None:
    import xxhash

    from slime_async.buffer.wal import _HEADER, _XXH3, RecordType

    buf = Buffer.open(tmp_path, group_size=1, max_staleness=1)
    buf.add(traj("g", 0))
    buf.close()
    data = (tmp_path / WAL_FILE).read_bytes()
    length, checksum, rtype = _HEADER.unpack_from(data)
    assert rtype == RecordType.TRAJECTORY | _XXH3
    assert checksum == xxhash.xxh3_64_intdigest(data[_HEADER.size : _HEADER.size + length]) & 0xFFFFFFFF


def test_server_settings_come_from_the_config_tree(tmp_path: Path) -> None:
    from slime_async.buffer import ServerSettings
    from slime_async.config import ConfigError, load_config

    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=r1", "rollout.group_size=4", "buffer.capacity=16"])
    s = ServerSettings.from_config(cfg)
    assert (s.group_size, s.max_staleness, s.buffer.capacity) == (4, cfg.rollout.max_staleness, 16)
    assert s.wal_dir == str(tmp_path / "r1" / "buffer-wal")
    with pytest.raises(ConfigError, match=r"buffer\.sender_credits"):
        load_config(None, ["buffer.sender_credits=0"])


def test_applied_batches_stay_until_a_checkpoint_holds_them_and_come_back_after_a_rollback(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=10)
    for k in range(6):
        buf.add(traj(f"g{k}", 0))
    batches = {}
    for v in range(1, 5):  # versions 1..4, one batch each; a checkpoint at 2 only
        batches[v] = buf.get_batch(1, batch_id=100 + v)
        buf.set_version(v, trained=[100 + v], committed=2 if v == 2 else None)
        m = balanced(buf)
    assert (m["trained"], m["applied"], m["delivered"], m["ready"]) == (2, 2, 0, 2), m
    buf.close()
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=10)  # the WAL keeps them as they were
    assert balanced(buf) == m
    buf.set_version(2, restarted=True)  # the trainer died at 4 and came back from the checkpoint at 2
    m = balanced(buf)
    assert (m["trained"], m["applied"], m["ready"], m["version"]) == (2, 0, 4, 2), m
    again = [buf.get_batch(1, batch_id=200 + k) for k in range(2)]
    assert [ids(b) for b in again] == [ids(batches[3]), ids(batches[4])]  # the same batches, in order
    buf.set_version(3, trained=[200])
    buf.set_version(4, trained=[201])
    buf.compact()  # the snapshot keeps what is applied and not committed
    buf.close()
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=10)
    m = balanced(buf)
    assert (m["trained"], m["applied"], m["ready"]) == (2, 2, 2), m
    buf.set_version(4, restarted=True)  # a restart from the checkpoint at 4 commits both
    assert (balanced(buf)["trained"], balanced(buf)["applied"]) == (4, 0)
    buf.close()


def test_tokens_of_a_version_no_trainer_reached_are_dropped_as_ahead(tmp_path: Path) -> None:
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=2)
    buf.set_version(5)
    buf.set_version(3, restarted=True)  # rolled back to 3: versions up to 5 were reached
    buf.add(traj("rolled", 0, version=5))  # old weights' tokens: ordinary off-policy data
    buf.add(traj("future", 0, version=10**9))  # junk: it would never go stale
    assert buf.get_batch(1, batch_id=1) is not None
    m = balanced(buf)
    assert (m["dropped_ahead"], m["ready"]) == (1, 0) and m["delivered"] == 1, m
    buf.close()
    buf = Buffer.open(tmp_path, group_size=1, max_staleness=2)
    assert balanced(buf) == m  # the decision is in the WAL: replay does not re-make it
    buf.add(traj("next", 0, version=6))  # the engines hear of 6 before the buffer does:
    buf.set_version(6)  # by the trainer's next request for a batch, the buffer has heard it too
    assert ids(buf.get_batch(1, batch_id=2)) == ["next-0"]
