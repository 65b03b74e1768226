"""Child processes of the local launcher: started, watched for their ready line, logged, stopped.

Every part runs as its own OS process (`python -m ...`). Its output goes to a log file (and is
kept in memory for error messages); the launcher waits, bounded, for the line by which each part
says it is ready: `serving on URL` (engine), `READY ENDPOINT` (buffer), `READY` (rollout worker,
trainer).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REAP_GRACE_S = 10.0
"""How long what a group's leader left behind gets to end by itself (SIGTERM) before SIGKILL."""


@dataclass
class ChildProcess:
    """A started part: its process, what its ready line said, and its output so far."""

    name: str
    argv: list[str]
    proc: subprocess.Popen
    ready: str
    """The first match group of the ready pattern (a URL, an endpoint), or the whole line."""
    log: list[str] = field(default_factory=list)
    log_path: Path | None = None
    own_group: bool = False
    """It leads a process group of its own: once it is gone, whatever it started goes too (`_reap`)."""
    _terminated: float | None = None
    _reaped: bool = False

    @property
    def url(self) -> str:  # engines: the URL they serve on
        return self.ready

    @property
    def returncode(self) -> int | None:
        return self._reap(self.proc.poll())

    def alive(self) -> bool:
        return self._reap(self.proc.poll()) is None

    def _reap(self, code: int | None, wait: bool = False) -> int | None:
        """Once the leader exited, end what is left of its group: a vLLM server killed by SIGKILL (or
        crashed) leaves its engine-core and worker processes running, holding GBs of memory, and
        they do not notice (seen: still there 15 s later). SIGTERM first, so that they (and the
        resource tracker) remove their shared-memory files (a SIGKILL left 400 MB in /dev/shm per
        server), SIGKILL what is left after `REAP_GRACE_S`. Without `wait`, one step per call."""
        if code is None or not self.own_group or self._reaped:
            return code
        deadline = (self._terminated or time.monotonic()) + REAP_GRACE_S
        while True:
            try:
                if self._terminated is None:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self._terminated = time.monotonic()
                elif time.monotonic() >= deadline:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self._reaped = True
                else:
                    os.killpg(self.proc.pid, 0)  # anyone left?
            except (ProcessLookupError, PermissionError):
                self._reaped = True  # the group is empty
            if self._reaped or not wait:
                return code
            time.sleep(0.1)  # they are shutting down: look again

    def exit_reason(self) -> str:
        return f"exited with code {self.proc.poll()}"

    def tail(self, n: int = 20) -> str:
        return "".join(self.log[-n:])

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._reap(self.proc.returncode, wait=True)


EngineProcess = ChildProcess


def start_process(name: str, argv: list[str], ready_pattern: str | None, timeout: float = 120.0,
                  log_path: Path | None = None, env: dict[str, str] | None = None,
                  cwd: str | None = None, parent_death_signal: int = signal.SIGTERM,
                  own_group: bool = False) -> ChildProcess:
    """Start `argv` and wait (bounded) for a line matching `ready_pattern` (None: do not wait).

    `env` adds to (and overrides) this process's environment. The child gets `parent_death_signal`
    when this process dies. With `own_group` it leads a new process group, which goes with it
    (`ChildProcess._reap`): for servers that start processes of their own (vLLM). It then runs under
    `group_guard`, which leads the group, gets SIGTERM when this process dies and ends the whole group
    (a parent-death signal reaches only a direct child: vLLM's engine core outlived its API server).
    Raises RuntimeError naming the part, with the tail of its output, if it exits or stays silent past
    `timeout`.
    """
    log_file: IO[str] | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("a")
    command = argv
    if own_group:  # the guard must catch its parent's death to end the group: SIGTERM, whatever was asked
        command = [sys.executable, "-m", "slime_async.launch.group_guard", *argv]
        parent_death_signal = signal.SIGTERM
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=functools.partial(_die_with_parent, parent_death_signal),
                            env={**os.environ, **env} if env else None, cwd=cwd,
                            process_group=0 if own_group else None)
    log: list[str] = []
    found = threading.Event()
    ready: list[str] = []
    pattern = re.compile(ready_pattern) if ready_pattern is not None else None

    def read() -> None:  # keeps draining the pipe so the child never blocks on a full buffer
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if len(log) > 2000:
                del log[:1000]
            if log_file is not None:
                log_file.write(line)
                log_file.flush()
            match = pattern.search(line) if pattern is not None else None
            if match and not found.is_set():
                ready.append(match.group(1) if match.groups() else line.strip())
                found.set()
        found.set()
        if log_file is not None:
            log_file.close()

    threading.Thread(target=read, name=f"log {name}", daemon=True).start()
    if pattern is None:
        return ChildProcess(name, argv, proc, "", log, log_path, own_group)
    if not found.wait(timeout) or not ready:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{name} did not start (exit code {proc.returncode}):\n" + "".join(log[-30:]))
    return ChildProcess(name, argv, proc, ready[0], log, log_path, own_group)


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: the launcher's shutdown is the only guard
        return None


# Loaded here, not in the child between fork and exec: a Ray actor (launch.ray_actor) has many
# threads, and loading a library in a forked child of a threaded process can deadlock.
_LIBC = _load_libc()


def _die_with_parent(sig: int) -> None:
    """In the child, before exec: get `sig` when the launcher dies, however it dies (Linux), so a
    killed launcher leaves no engines, buffers or workers behind."""
    if _LIBC is not None:
        _LIBC.prctl(1, sig)  # PR_SET_PDEATHSIG = 1


def start_engine(model_dir: str | Path, *args: str, timeout: float = 120.0, port: int = 0,
                 log_path: Path | None = None, name: str = "engine", env: dict[str, str] | None = None
                 ) -> ChildProcess:
    """Start `slime-async serve --model DIR --port PORT ARGS`; `.url` is where it serves."""
    argv = [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(model_dir), "--port", str(port), *args]
    return start_process(name, argv, r"serving on (http://\S+)", timeout, log_path, env=env)
