"""A Ray actor that owns one part's process on the node Ray placed it on, and the driver's handle to it.

The part itself runs exactly as in local mode (`python -m slime_async.buffer`, `slime-async serve`,
`python -m sglang.launch_server`, the trainer and rollout workers): the actor starts it with
`process.start_process`, fills in the node's address and a free port there, writes the files it
is handed (the config, CURVE keys) into a private directory of its own, waits for the part to be
ready, and answers the driver's polls. When the actor dies (killed, its node lost), the process dies
with it at once (PR_SET_PDEATHSIG, SIGKILL), so a restart never meets an orphan on the same port.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from slime_async.launch.health import wait_healthy
from slime_async.launch.local import HOST, fill, free_port
from slime_async.launch.process import ChildProcess, start_process
from slime_async.launch.sglang_command import preflight

SECRETS = "@SECRETS@"
"""Placeholder for the actor's private directory, in command lines and in the files it writes."""


class PartActor:
    """Use through `ray.remote(PartActor)`; one instance per process (a restart makes a new actor)."""

    def __init__(self, name: str, cwd: str | None = None) -> None:
        self.name = name
        self.cwd = cwd if cwd is not None and Path(cwd).is_dir() else None
        self.dir = Path(tempfile.mkdtemp(prefix=f"slime_async-{name}-"))  # mode 0700: keys live here
        self.child: ChildProcess | None = None

    def node(self, host: str | None = None) -> tuple[str, int]:
        """The address this part binds to and announces (`host`, or the node's IP as Ray knows it), and a
        port that is free there now."""
        import ray

        address = host or ray.util.get_node_ip_address()
        return address, free_port(address)

    def start(self, argv: list[str], ready: str | None, *, host: str, port: int, files: dict[str, bytes],
              env: dict[str, str], log_path: str, timeout: float, health_url: str | None = None,
              wait: bool = True, own_group: bool = False) -> str:
        """Start the part; return what its ready line said (or its health URL). With `wait=False` return
        at once, and call `wait_ready` later (ranks that wait for each other start together)."""
        for relative, content in files.items():
            path = self.dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.replace(SECRETS.encode(), str(self.dir).encode()).replace(HOST.encode(),
                                                                                                 host.encode()))
            path.chmod(0o600)
        config = str(self.dir / "config.yaml")
        argv = [fill(a, host, port, config).replace(SECRETS, str(self.dir)) for a in argv]
        preflight(argv)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:  # the command heads its log (an SGLang server's flags, say)
            log.write(f"$ {redacted(argv)}\n")
        # SIGKILL when the actor dies: the part goes at once, as its actor did, so that its replacement
        # never overlaps with it (two trainers, or an old engine on the port)
        self.child = start_process(self.name, argv, ready if wait else None, timeout, Path(log_path), env=env,
                                   cwd=self.cwd, parent_death_signal=signal.SIGKILL, own_group=own_group)
        self._ready = ready
        if health_url is not None:
            url = fill(health_url, host, port, config)
            try:
                wait_healthy(url, timeout, alive=self.child.alive)
            except (TimeoutError, RuntimeError) as exc:
                self.child.stop()
                raise RuntimeError(f"{self.name}: {exc}; last lines of its log:\n{self.child.tail()}") from None
            self.child.ready = url
        return self.child.ready

    def wait_ready(self, timeout: float) -> str:
        """After `start(wait=False)`: wait (bounded) for the ready line; its first group, or the line."""
        assert self.child is not None and self._ready is not None
        pattern = re.compile(self._ready)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.child.log):
                match = pattern.search(line)
                if match:
                    self.child.ready = match.group(1) if match.groups() else line.strip()
                    return self.child.ready
            if not self.child.alive():
                break
            time.sleep(0.1)  # its output arrives on the reader thread
        raise RuntimeError(f"{self.name} did not start (exit code {self.child.returncode}):\n{self.child.tail(30)}")

    def poll(self) -> tuple[int | None, str]:
        """The process's exit code (None while it runs) and, once it exited, the tail of its output."""
        assert self.child is not None
        code = self.child.returncode
        return code, self.child.tail() if code is not None else ""

    def stop(self, timeout: float = 20.0) -> int | None:
        code = self.child.stop(timeout) if self.child is not None else None
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


def redacted(argv: list[str]) -> str:
    """The command as a shell line, with the values of token and key options hidden."""
    shown = [("***" if i and any(w in argv[i - 1] for w in ("token", "key")) and argv[i - 1].startswith("--")
              else a) for i, a in enumerate(argv)]
    return shlex.join(shown)


class RayChild:
    """The driver's view of a part running under a `PartActor` (the `local.Child` interface)."""

    def __init__(self, name: str, actor: Any, ready: str, log_path: Path) -> None:
        self.name = name
        self.actor = actor
        self.ready = ready
        self.log_path = log_path
        self._code: int | None = None
        self._dead: str | None = None
        self._tail = ""

    @property
    def url(self) -> str:
        return self.ready

    @property
    def returncode(self) -> int | None:
        return self._code

    def alive(self) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._dead is not None or self._code is not None:
            return False
        try:
            self._code, self._tail = ray.get(self.actor.poll.remote(), timeout=30)
        except RayActorError as exc:
            self._dead = f"lost its Ray actor ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            return False
        except GetTimeoutError:
            return True  # the actor is busy, not dead: ask again at the next check
        return self._code is None

    def exit_reason(self) -> str:
        return self._dead or f"exited with code {self._code}"

    def tail(self, n: int = 20) -> str:
        if not self._tail and self.log_path.is_file():  # the actor is gone; its log file may be here
            self._tail = "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])
        return "".join(self._tail.splitlines(keepends=True)[-n:])

    def stop(self, timeout: float = 20.0) -> int | None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            code = ray.get(self.actor.stop.remote(timeout), timeout=timeout + 30)
            self._code = self._code if code is None else code
        except (RayActorError, GetTimeoutError):
            pass  # already gone, or hung: the kill below ends it (and its process with it)
        ray.kill(self.actor)
        return self._code
