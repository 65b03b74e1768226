"""Real processes for the end-to-end tests: a buffer server and rollout-worker stand-ins.

Each process's stdout is read by a thread into a list of lines; tests wait on conditions over
those lines (or over the server's metrics) with bounded timeouts, never on fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from slime_async.buffer import ServerSettings

SENDER_MAIN = Path(__file__).with_name("sender_main.py")
REPO = Path(__file__).resolve().parents[2]


class Proc:
    """A child process whose stdout lines are collected as they come."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(self.popen.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.popen.stderr, self.stderr), daemon=True).start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._changed:
                sink.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}; stderr:\n" + self.tail())
                self._changed.wait(min(left, 0.5))

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.stderr[-n:])

    def acked(self) -> list[str]:
        return [line.split()[1] for line in list(self.lines) if line.startswith("ACK ")]

    def stat(self, name: str) -> int:
        """A counter from the sender's final `STATS k=v ...` line."""
        line = next(line for line in self.lines if line.startswith("STATS "))
        return int(dict(kv.split("=") for kv in line.split()[1:])[name])

    def done(self) -> bool:
        return "DONE" in self.lines

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def start_server(settings: ServerSettings, timeout: float = 30.0) -> tuple[Proc, str]:
    """Start `python -m slime_async.buffer`; return it and the endpoint it bound."""
    proc = Proc([sys.executable, "-m", "slime_async.buffer", msgspec.json.encode(settings).decode()])
    proc.wait_for(lambda: any(line.startswith("READY ") for line in proc.lines) or proc.popen.poll() is not None,
                  timeout, "the buffer server to bind")
    ready = [line for line in proc.lines if line.startswith("READY ")]
    assert ready, f"buffer server exited with {proc.popen.poll()}:\n{proc.tail()}"
    return proc, ready[0].split()[1]


def start_sender(endpoint: str, prefix: str, count: int, group_size: int, *extra: str) -> Proc:
    return Proc([sys.executable, str(SENDER_MAIN), endpoint, prefix, str(count), str(group_size), *extra])
