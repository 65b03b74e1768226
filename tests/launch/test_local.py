"""Local launcher: buffer, engine and rollout worker as real processes; a killed part comes back."""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from slime_async.buffer import BufferClient
from slime_async.config import load_config, to_yaml
from slime_async.launch import local
from slime_async.launch.local import HOST, PORT, LocalLauncher, PartFailed, compute_threads

pytestmark = pytest.mark.slow


def omp_threads(pid: int) -> str | None:
    """A running process's OMP_NUM_THREADS, read from /proc."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"OMP_NUM_THREADS="):
            return entry.split(b"=", 1)[1].decode()
    return None


def test_cores_are_shared_among_the_processes_that_compute() -> None:
    cores = len(os.sched_getaffinity(0))
    cfg = load_config(None, ["engine.num_engines=3"])
    assert compute_threads(cfg, with_trainer=True) == max(1, cores // 4)
    attached = load_config(None, ["engine.urls=[http://x:1]"])
    assert compute_threads(attached, with_trainer=True) == cores  # the trainer alone computes here


def test_rollout_side_streams_and_a_killed_worker_is_restarted(tmp_path: Path, varied_model_dir: Path) -> None:
    cfg = load_config(None, [
        f"model.path={varied_model_dir}", "model.device=cpu", "engine.port=0", "rollout.group_size=2",
        "rollout.batch_size=4", "rollout.max_staleness=100", "rollout.sampling.max_new_tokens=8",
        "rollout.filter_equal_rewards=false", f"run.dir={tmp_path}", "launch.max_restarts=1",
    ])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(to_yaml(cfg))
    launcher = LocalLauncher(cfg, config_path, tmp_path / "run", with_trainer=False)
    events: list[str] = []
    launcher.start(on_event=events.append)
    trainer = BufferClient(launcher.buffer_endpoint)
    try:
        assert [p.name for p in launcher.parts] == ["buffer", "engine-0", "rollout-0"]
        # the engine computes alone here (no trainer): every core; the rollout worker waits: one thread
        if "OMP_NUM_THREADS" not in os.environ:
            assert omp_threads(launcher.part("engine-0").child.proc.pid) == str(compute_threads(cfg, False))
            assert compute_threads(cfg, False) == len(os.sched_getaffinity(0))
            assert omp_threads(launcher.part("rollout-0").child.proc.pid) == "1"
        batch = trainer.get_batch(4, timeout=120)
        assert sum(len(g.trajectories) for g in batch.groups) >= 4
        worker = launcher.part("rollout-0")
        first = worker.child
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        launcher.check()
        assert worker.restarts == 1 and worker.child is not first and worker.child.alive()
        assert "rollout-0 exited with code -9" in events[0] and "rollout-0 restarted (1/1)" in events[1]
        trainer.set_version(1)
        again = trainer.get_batch(4, timeout=120)  # the restarted worker streams again
        assert again.batch_id != batch.batch_id
        worker.child.proc.send_signal(signal.SIGKILL)
        worker.child.proc.wait()
        with pytest.raises(PartFailed, match="rollout-0 was restarted 1 times already: stopping"):
            launcher.check()
        assert (tmp_path / "run" / "logs" / "engine-0.log").read_text().startswith("serving on")
    finally:
        trainer.close()
        launcher.shutdown()
    assert all(not p.child.alive() for p in launcher.parts)


def test_a_part_whose_port_is_taken_before_it_binds_it_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()  # someone else took the port between the launcher's choosing it and the part's binding it
    chosen = [held.getsockname()[1]]

    def free_port(host: str) -> int:
        port = chosen[-1] if len(chosen) == 1 else local.free_port.__wrapped__(host)
        chosen.append(port)
        return port

    monkeypatch.setattr(local, "free_port", functools.wraps(local.free_port)(free_port))
    launcher = LocalLauncher(load_config(None, [f"run.dir={tmp_path}"]), tmp_path / "config.yaml", tmp_path)
    web = [sys.executable, "-u", "-m", "http.server", PORT, "--bind", HOST]
    try:
        child = launcher.spawn("web", web, r"Serving HTTP on \S+ port (\d+)")
        assert chosen[1:] == [held.getsockname()[1], int(child.ready)] and chosen[2] != chosen[1]
        assert launcher.events == [f"web: port {chosen[1]} was taken before it bound it; trying another"]
        child.stop()
        # a port the config names is not changed: the error says why it did not start
        with pytest.raises(RuntimeError, match="Address already in use"):
            launcher.spawn("web", web, r"Serving HTTP on \S+ port (\d+)", port=held.getsockname()[1])
    finally:
        held.close()
