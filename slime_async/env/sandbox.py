"""A sandbox for model-written code: a separate process with resource limits, no network, its own
temporary directory and a wall-clock kill.

Layers (each reported in `SandboxResult.isolation`, so a caller can see what it got):
- rlimits: CPU seconds, address space, file size, open files, no core dumps; and processes
  (`RLIMIT_NPROC`), which the kernel enforces only for a non-root user — hence:
- user: when started as root, the code runs as `nobody` (uid/gid 65534), so it cannot write
  anything that root owns; its own temporary directory is handed to `nobody`.
- Linux namespaces, tried in order: network + mount + pid (as root; `unshare(2)`), else a user
  namespace with network (unprivileged kernels allow it), else none.
  network: a fresh namespace whose only interface is a loopback that is down; nothing connects.
  mount: private tmpfs over /tmp, /var/tmp and /dev/shm, so world-writable places the code could
  write to vanish with it; pid: a fresh /proc, and every process dies with the sandbox's first.
- Fallback where no network namespace can be made (documented, weaker): an audit hook in the
  sandboxed interpreter refuses sockets. It stops ordinary code, not a determined escape (ctypes
  can bypass it); `isolation["network"]` is then "audit-hook", and tests that need real
  isolation say so.
- Processes: `RLIMIT_NPROC` counts every process of the user, so concurrent sandboxes (all
  `nobody`) share `max_processes`; size it for the concurrency.
- Wall clock: the whole process group is killed (SIGKILL) past `wall_s`; output past
  `max_output_bytes` is dropped, so a program that prints forever cannot fill memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from typing import Annotated

import msgspec

NOBODY = 65534


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cpu_s: Annotated[int, msgspec.Meta(ge=1)] = 5
    """CPU seconds per process (SIGXCPU, then SIGKILL)."""
    wall_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    memory_mb: Annotated[int, msgspec.Meta(ge=32)] = 512
    """Address space per process (allocations past it fail: MemoryError)."""
    file_size_mb: Annotated[int, msgspec.Meta(ge=0)] = 16
    """Largest file the code may write (past it: OSError 'File too large')."""
    max_processes: Annotated[int, msgspec.Meta(ge=1)] = 32
    """Processes of the sandbox user (fork past it fails)."""
    open_files: Annotated[int, msgspec.Meta(ge=16)] = 64
    max_output_bytes: Annotated[int, msgspec.Meta(ge=0)] = 65536
    """Of stdout and of stderr, each; the rest is dropped (and said so)."""
    tmpfs_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm) in the mount namespace."""


class SandboxResult(msgspec.Struct, kw_only=True):
    exit_code: int | None
    """The program's exit status; negative: killed by that signal; None: killed at the wall clock."""
    stdout: str
    stderr: str
    timed_out: bool = False
    """Killed past `wall_s`."""
    pgid: int = 0
    """The sandbox's process group (gone when `run_python` returns)."""
    output_truncated: bool = False
    isolation: dict[str, str] = {}
    """What isolation applied: network (namespace | user-namespace | audit-hook), mount, pid, user."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


async def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    files: dict[str, str] | None = None,
    stdin: str = "",
    namespaces: bool = True,
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox directory (with `files` beside it) and return its
    outcome. Never raises for anything the code does. `namespaces=False` skips the Linux
    namespaces (the documented fallback: tests use it, and hosts whose policy forbids unshare)."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="slime-sandbox-")
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            path = os.path.realpath(os.path.join(workdir, name))
            if not path.startswith(workdir + os.sep):
                raise ValueError(f"sandbox file name {name!r} leaves the sandbox directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        if os.geteuid() == 0:
            for root, dirs, names in os.walk(workdir):
                for n in [root] + [os.path.join(root, x) for x in dirs + names]:
                    os.chown(n, NOBODY, NOBODY)
        return await _run(workdir, limits, stdin, namespaces)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(workdir: str, limits: SandboxLimits, stdin: str, namespaces: bool) -> SandboxResult:
    pythons = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    config = msgspec.json.encode(
        {"workdir": workdir, "limits": limits, "pythons": pythons, "namespaces": namespaces}
    ).decode()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _BOOTSTRAP, config,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: one kill reaches every process it made
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )  # fmt: skip
    assert proc.stdin and proc.stdout and proc.stderr
    out, err = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes)
    readers = [asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
    timed_out = False
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except TimeoutError:
            timed_out = True
    finally:
        # Always, also on cancellation: no process of the sandbox outlives this call.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        await _until_gone(proc.pid)
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    stderr, isolation = _split_status(err.text())
    return SandboxResult(
        exit_code=None if timed_out else proc.returncode,
        stdout=out.text(),
        stderr=stderr,
        timed_out=timed_out,
        pgid=proc.pid,
        output_truncated=out.dropped > 0 or err.dropped > 0,
        isolation=isolation,
    )


async def _until_gone(pgid: int, poll_s: float = 0.01, give_up_s: float = 10.0) -> None:
    """Wait until the killed group has no process left: SIGKILLed processes (a fork bomb's
    hundreds) take a moment to exit and be reaped by whoever inherits them."""
    for _ in range(int(give_up_s / poll_s)):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        await asyncio.sleep(poll_s)


class _Capped:
    def __init__(self, cap: int) -> None:
        self.cap, self.buf, self.dropped = cap, bytearray(), 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            keep = max(0, self.cap - len(self.buf))
            self.buf += chunk[:keep]
            self.dropped += len(chunk) - min(keep, len(chunk))

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


_STATUS = "\x00sandbox-isolation "


def _split_status(stderr: str) -> tuple[str, dict[str, str]]:
    if not stderr.startswith(_STATUS):
        return stderr, {}
    line, _, rest = stderr.partition("\n")
    return rest, msgspec.json.decode(line[len(_STATUS) :])


# Runs in the child, as root or not, before the model's code: namespaces, rlimits, dropping to
# nobody, then exec of a fresh interpreter on main.py. Kept as source text (run with -I -S) so
# that nothing of the parent's imports or environment reaches the sandbox.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1]); lim = cfg["limits"]; workdir = cfg["workdir"]
os.chdir(workdir)
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWNET, NEWPID, NEWUSER = 0x00020000, 0x40000000, 0x20000000, 0x10000000
iso = {"network": "audit-hook", "mount": "none", "pid": "none", "user": "unchanged"}
if not cfg["namespaces"]:
    pass
elif libc.unshare(NEWNET | NEWNS | NEWPID) == 0:
    iso.update(network="namespace", mount="namespace", pid="namespace")
elif libc.unshare(NEWUSER | NEWNET) == 0:
    iso.update(network="user-namespace")
if iso["mount"] == "namespace":
    MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    keep = os.open(workdir, os.O_PATH)
    for d in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        opts = b"size=%dm,mode=1777" % lim["tmpfs_mb"]
        if os.path.isdir(d) and libc.mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
            raise OSError(ctypes.get_errno(), "cannot mount a private tmpfs on " + d.decode())
    # The work directory (under the host's /tmp, now hidden) reappears at a fixed path.
    os.mkdir("/tmp/sandbox")
    if libc.mount(b"/proc/self/fd/%d" % keep, b"/tmp/sandbox", None, 4096, None) != 0:  # MS_BIND
        raise OSError(ctypes.get_errno(), "cannot bind the sandbox directory")
    os.close(keep)
    workdir = "/tmp/sandbox"
    os.chdir(workdir)
if iso["pid"] == "namespace":
    pid = os.fork()  # the child is pid 1 of the new namespace: when it dies, all of its kind die
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)
    MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
mb = 1024 * 1024
for res, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mb"] * mb),
                   (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mb), (resource.RLIMIT_NOFILE, lim["open_files"]),
                   (resource.RLIMIT_NPROC, lim["max_processes"]), (resource.RLIMIT_CORE, 0)):
    # CPU: a soft limit one second under the hard one, so the code gets SIGXCPU before SIGKILL.
    resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
python = None
if os.geteuid() == 0:
    # The interpreter must be one that nobody may run (a pyenv or venv under /root is not).
    os.setegid(65534); os.seteuid(65534)
    python = next((p for p in cfg["pythons"] if os.access(p, os.X_OK, effective_ids=True)), None)
    os.seteuid(0); os.setegid(0)
    if python is not None:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        iso["user"] = "nobody"
    else:
        iso["user"] = "root (no interpreter that nobody may run)"
python = python or sys.executable
sys.stderr.write("\x00sandbox-isolation " + json.dumps(iso) + "\n"); sys.stderr.flush()
env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
runner = (
    "import os, sys, runpy\n"
    "if sys.argv[1] == 'audit-hook':\n"
    "    def _hook(event, args):\n"
    "        if event.startswith(('socket.', 'urllib.')):\n"
    "            raise PermissionError('network access is not allowed in the sandbox')\n"
    "    sys.addaudithook(_hook)\n"
    "del sys.argv[1]\n"
    "sys.path.insert(0, os.getcwd())\n"
    "runpy.run_path('main.py', run_name='__main__')\n"
)
os.execve(python, [python, "-I", "-c", runner, iso["network"]], env)
"""
