"""Starting an embedded engine as its own process and waiting until it serves."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineProcess:
    """A `slime-async serve` child process, the URL it printed once bound, and its output so far."""

    proc: subprocess.Popen
    url: str
    log: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(model_dir: str | Path, *args: str, timeout: float = 120.0) -> EngineProcess:
    """Start `slime-async serve --model DIR --port 0 ARGS` and wait (bounded) for `serving on URL`.

    Raises RuntimeError with the tail of its output if it exits or stays silent past `timeout`.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(model_dir), "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:  # keeps draining the pipe so the child never blocks on a full buffer
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            match = re.search(r"serving on (http://\S+)", line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout) or not url:
        proc.kill()
        proc.wait()
        raise RuntimeError("the engine did not start:\n" + "".join(log[-30:]))
    return EngineProcess(proc, url[0], log)
