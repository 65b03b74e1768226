"""A part that leads its own process group (a vLLM server) runs under `launch.group_guard`: when the
part dies, or the launcher that started it, whatever the part started is asked to end (SIGTERM: it
cleans up its shared memory), then killed; nothing is left behind, and the part's exit code is what
the launcher sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from slime_async.launch.process import start_process

# the leader starts a helper (as vLLM its engine core) that cleans up on SIGTERM, then waits
LEADER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
    while not os.path.exists(sys.argv[1]):  # the helper is set up once its file is there
        time.sleep(0.01)
    print("up", os.getpid(), helper.pid, flush=True)
    time.sleep(10_000)
""")
HELPER = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *_: (os.unlink(marker), os._exit(0)))
    open(marker, "w").write("shared memory")
    time.sleep(10_000)
""")
# a launcher: starts the leader as the local launcher starts vLLM, says the pids, then waits to be killed
LAUNCHER = textwrap.dedent("""
    import sys
    from slime_async.launch.process import start_process
    child = start_process("leader", [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], r"^up (.*)",
                          own_group=True)
    print(child.proc.pid, child.ready, flush=True)
    import time; time.sleep(10_000)
""")


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its parent counts: it runs nothing and holds no memory)."""
    path = Path(f"/proc/{pid}/stat")
    try:
        return path.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running after {timeout} s: {[p for p in pids if not gone(p)]}"
        time.sleep(0.05)


def test_what_a_killed_leader_started_cleans_up_and_goes(tmp_path: Path) -> None:
    marker = tmp_path / "psm_segment"
    child = start_process("leader", [sys.executable, "-c", LEADER, str(marker), HELPER], r"^up (.*)",
                          own_group=True)
    leader, helper = map(int, child.ready.split())
    assert marker.exists() and os.getpgid(leader) == os.getpgid(helper) == child.proc.pid
    os.kill(leader, signal.SIGKILL)  # as the OOM killer would
    # the guard ends the rest of the group and passes the leader's end on (128 + 9), launcher or not
    assert child.proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert not marker.exists()  # it got SIGTERM, not only SIGKILL: it removed its file
    wait_gone([helper])
    assert child.stop() == 128 + signal.SIGKILL


def test_a_killed_launcher_takes_the_whole_group_with_it(tmp_path: Path) -> None:
    # a parent-death signal reaches only a direct child: vLLM's engine core outlived its API server's
    # SIGKILL'd launcher (or Ray actor) before the guard
    marker = tmp_path / "psm_segment"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, LEADER, str(marker), HELPER],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        guard, leader, helper = map(int, launcher.stdout.readline().split())
        assert marker.exists()
        launcher.kill()
        launcher.wait()
        wait_gone([guard, leader, helper])
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not marker.exists()  # the helper got SIGTERM first
