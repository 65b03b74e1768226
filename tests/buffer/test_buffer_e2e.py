"""End to end over real sockets and real processes: senders -> buffer server process -> trainer client.

The trainer is this test process (a `BufferClient`); senders are `sender_main.py` processes; the
buffer is `python -m slime_async.buffer`. The promises checked: every acked trajectory reaches
the trainer exactly once, across a kill -9 of the buffer and of a sender, and the accounting
received == trained + buffered + dropped holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from buffer_procs import Proc, start_sender, start_server

from slime_async.buffer import BufferClient, ServerSettings
from slime_async.config.schema import BufferConfig

GROUP = 4


def settings(endpoint: str, wal_dir: Path | None, max_staleness: int = 10**6, **buffer: object) -> ServerSettings:
    cfg = BufferConfig(endpoint=endpoint, heartbeat_s=0.2, heartbeat_timeout_s=1.0, **buffer)  # type: ignore[arg-type]
    return ServerSettings(
        buffer=cfg, group_size=GROUP, max_staleness=max_staleness, wal_dir=str(wal_dir) if wal_dir else None
    )


def drain(
    client: BufferClient, expected: int, batch: int, deadline_s: float, on_batch=None, version: int = 0
) -> list[str]:
    """Take batches until `expected` trajectories came, reporting each trained; return their ids."""
    ids: list[str] = []
    deadline = time.monotonic() + deadline_s
    while len(ids) < expected:
        assert time.monotonic() < deadline, f"only {len(ids)} of {expected} trajectories reached the trainer"
        try:
            b = client.get_batch(min(batch, expected - len(ids)), timeout=2.0)
        except TimeoutError:
            continue
        ids += [t.id for g in b.groups for t in g.trajectories]
        if on_batch is not None:
            on_batch(len(ids))
        version += 1
        client.set_version(version, committed=version)  # as a trainer that checkpoints every step
    return ids


def assert_accounting(m: dict[str, int]) -> None:
    assert m["received"] == m["trained"] + m["buffered"] + m["dropped_total"], m


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_several_senders_one_buffer_exactly_once(tmp_path: Path, transport: str) -> None:
    endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/buffer.sock"
    server, endpoint = start_server(settings(endpoint, tmp_path / "wal"))
    senders = [
        start_sender(endpoint, "a", 120, GROUP),
        start_sender(endpoint, "b", 120, GROUP, "--sync"),
        start_sender(endpoint, "c", 120, GROUP, "--tokens", "4096"),
    ]
    try:
        with BufferClient(endpoint, retry_s=0.2) as client:
            client.set_version(0, restarted=True)
            ids = drain(client, 360, 32, 60)
            for s in senders:
                s.wait_for(s.done, 30, "the sender to finish")
            assert len(ids) == len(set(ids)) == 360
            assert set(ids) == {i for s in senders for i in s.acked()}
            m = client.metrics()
            assert (m["received"], m["trained"], m["buffered"], m["duplicates"]) == (360, 360, 0, 0)
            assert_accounting(m)
    finally:
        for p in [*senders, server]:
            p.stop()


@pytest.mark.slow
def test_kill9_buffer_mid_stream_loses_nothing_acked_and_delivers_nothing_twice(tmp_path: Path) -> None:
    # A small capacity keeps the senders blocked on credits, so the kill lands mid-stream.
    cfg = settings("tcp://127.0.0.1:0", tmp_path / "wal", capacity=48, sender_credits=8)
    server, endpoint = start_server(cfg)
    cfg = settings(endpoint, tmp_path / "wal", capacity=48, sender_credits=8)  # same port after restart
    total = 3 * 160
    senders = [start_sender(endpoint, name, 160, GROUP, *(("--sync",) if name == "y" else ())) for name in "xyz"]
    restarted: list[Proc] = []
    acked_before_kill: set[str] = set()

    def kill_and_restart(received: int) -> None:
        if not restarted and received >= 32:  # no sender can be done: 32 + capacity + credits < 160
            acked_before_kill.update(i for s in senders for i in s.acked())
            server.kill9()
            restarted.append(start_server(cfg)[0])

    try:
        with BufferClient(endpoint, retry_s=0.2) as client:
            # All three connected before the trainer takes anything: until the kill, the buffer then
            # holds at most 32 taken + 48 capacity + 3 * 8 credits < 160, so no sender can be done.
            deadline = time.monotonic() + 30
            while client.metrics()["peers"] < 3:
                assert time.monotonic() < deadline, "the senders never connected"
                time.sleep(0.05)
            client.set_version(0, restarted=True)
            ids = drain(client, total, 16, 90, on_batch=kill_and_restart)
            for s in senders:
                s.wait_for(s.done, 30, "the sender to finish")
            assert restarted, "the buffer was never killed"
            assert all(s.stat("sessions") >= 2 for s in senders), "a sender never noticed the restart"
            counts = Counter(ids)
            assert [i for i, n in counts.items() if n > 1] == [], "delivered twice to the trainer"
            acked = {i for s in senders for i in s.acked()}
            assert acked_before_kill and acked_before_kill <= set(ids), "acked before the kill, then lost"
            assert set(ids) == acked and len(ids) == total
            m = client.metrics()
            assert (m["received"], m["trained"], m["buffered"]) == (total, total, 0), m
            assert_accounting(m)
    finally:
        for p in [*senders, server, *restarted]:
            p.stop()


@pytest.mark.slow
def test_kill9_sender_mid_send(tmp_path: Path) -> None:
    server, endpoint = start_server(settings("tcp://127.0.0.1:0", tmp_path / "wal", group_timeout_s=0.5))
    doomed = start_sender(endpoint, "doomed", 100_000, GROUP)
    steady = start_sender(endpoint, "steady", 200, GROUP)
    try:
        doomed.wait_for(lambda: len(doomed.acked()) >= 50, 30, "50 acks for the doomed sender")
        doomed.kill9()
        steady.wait_for(steady.done, 30, "the steady sender to finish")
        with BufferClient(endpoint, retry_s=0.2) as client:
            deadline = time.monotonic() + 20
            while (m := client.metrics())["peers_expired"] < 1 or m["pending"] > 0:
                assert time.monotonic() < deadline, f"dead sender never detected, or groups never released: {m}"
                time.sleep(0.05)  # polling a condition with a deadline, not waiting for it to happen
            assert_accounting(m)
            ids = drain(client, m["ready"], m["ready"], 30)
            assert len(ids) == len(set(ids))
            assert set(doomed.acked()) <= set(ids), "an acked trajectory of the killed sender was lost"
            assert set(steady.acked()) <= set(ids) and len(steady.acked()) == 200
            m = client.metrics()
            assert m["buffered"] == 0 and m["trained"] == len(ids)
            assert_accounting(m)
    finally:
        for p in (doomed, steady, server):
            p.stop()


def test_stale_trajectories_never_reach_the_trainer_and_are_counted(tmp_path: Path) -> None:
    server, endpoint = start_server(settings("tcp://127.0.0.1:0", tmp_path / "wal", max_staleness=2))
    old = start_sender(endpoint, "old", 40, GROUP, "--version", "0")
    new = start_sender(endpoint, "new", 40, GROUP, "--version", "3")
    try:
        for s in (old, new):
            s.wait_for(s.done, 30, "the sender to finish")
        with BufferClient(endpoint, retry_s=0.2) as client:
            client.set_version(3, restarted=True)  # old: 3 - 0 > 2, new: 3 - 3 = 0
            ids = drain(client, 40, 40, 30, version=3)
            assert sorted(ids) == sorted(new.acked())
            m = client.metrics()
            assert (m["dropped_stale"], m["trained"], m["buffered"]) == (40, 40, 0), m
            assert_accounting(m)
    finally:
        for p in (old, new, server):
            p.stop()


def test_a_storm_of_signals_stops_the_server() -> None:
    # Signals paced so that each is handled on its own, some inside the handling of the one before:
    # a handler that took a lock deadlocked there in about 4 of 10 servers (and after a launcher's
    # death in CI). Five servers, so that a lock in the handler would hang at least one.
    for _ in range(5):
        proc, _endpoint = start_server(settings("tcp://127.0.0.1:0", None))
        for i in range(3000):
            time.sleep(0.00002)
            if proc.popen.poll() is not None:
                break
            os.kill(proc.popen.pid, signal.SIGTERM if i % 2 else signal.SIGINT)
        try:
            code = proc.popen.wait(30)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            raise AssertionError("the buffer server did not stop after SIGTERM/SIGINT") from None
        # 0, or a signal of the storm that came after the interpreter, exiting, gave up its handlers
        assert code in (0, -signal.SIGTERM, -signal.SIGINT), proc.tail()


def test_a_starting_rollout_worker_counts_what_the_run_accepted(tmp_path: Path) -> None:
    # A resumed run's worker once started from accepted = 0: at version 10 with B = 4 and eta = 1 the
    # rule then admitted 48 where it allows 8. It asks the buffer: trained (committed) + buffered.
    from slime_async.rollout.worker import accepted_so_far

    server, endpoint = start_server(settings("tcp://127.0.0.1:0", tmp_path / "wal", max_staleness=2))
    old = start_sender(endpoint, "old", 8, GROUP, "--version", "0")
    new = start_sender(endpoint, "new", 32, GROUP, "--version", "3")
    try:
        for s in (old, new):
            s.wait_for(s.done, 30, "the sender to finish")
        with BufferClient(endpoint, retry_s=0.2) as client:
            client.set_version(3, restarted=True)  # the 8 old ones are stale now: dropped, not accepted
            drain(client, 16, 16, 30, version=3)  # 16 trained (and committed); 16 still buffered
            m = client.metrics()
        assert (m["trained"], m["buffered"], m["dropped_stale"]) == (16, 16, 8), m
        assert accepted_so_far(endpoint, None) == 32
    finally:
        for p in (old, new, server):
            p.stop()
    assert accepted_so_far(endpoint, None) is None  # no buffer: said, and the worker starts from 0
