"""A part that leads its own process group (a vLLM server): when it dies, whatever it started is
asked to end (SIGTERM: it cleans up its shared memory), then killed; nothing is left behind."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

from slime_async.launch.process import start_process

# the leader starts a helper (as vLLM its engine core) that cleans up on SIGTERM, then waits
LEADER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
    while not os.path.exists(sys.argv[1]):  # the helper is set up once its file is there
        time.sleep(0.01)
    print("up", helper.pid, flush=True)
    time.sleep(10_000)
""")
HELPER = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *_: (os.unlink(marker), os._exit(0)))
    open(marker, "w").write("shared memory")
    time.sleep(10_000)
""")


def test_what_a_killed_leader_started_cleans_up_and_goes(tmp_path: Path) -> None:
    marker = tmp_path / "psm_segment"
    child = start_process("leader", [sys.executable, "-c", LEADER, str(marker), HELPER], r"^up (\d+)",
                          own_group=True)
    helper = int(child.ready)
    assert marker.exists()
    os.kill(child.proc.pid, signal.SIGKILL)  # as the OOM killer would
    child.proc.wait()
    child.stop()
    assert not marker.exists()  # it got SIGTERM, not only SIGKILL: it removed its file
    assert not Path(f"/proc/{helper}").exists() or Path(f"/proc/{helper}/stat").read_text().split()[2] == "Z"
