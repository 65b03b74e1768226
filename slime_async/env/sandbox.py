"""A sandbox for model-written code: a separate process with resource limits, no network, its own
temporary directory and a wall-clock kill.

Layers (each reported in `SandboxResult.isolation`, so a caller can see what it got):
- rlimits: CPU seconds, address space, file size, open files, no core dumps; and processes
  (`RLIMIT_NPROC`), which the kernel enforces only for a non-root user — hence:
- user: when started as root, the code runs as `nobody` (uid/gid 65534), so it cannot write
  anything that root owns; its own temporary directory is handed to `nobody`. Where no Python
  interpreter is runnable by `nobody`, the code is not run at all (exit 126, said on stderr):
  model code never runs as root.
- cgroup (where this process may make one: root, cgroup v1 or v2 with the memory and pids
  controllers): `total_memory_mb` and `max_processes` for the call's processes together, and the
  list of all of them, so that every one is killed when the call ends, also one that called
  `setsid()` to leave the process group. Elsewhere the total is up to `memory_mb * max_processes`.
- Linux namespaces. network, in every mode: a fresh namespace whose only interface is a loopback
  that is down; nothing connects, a subprocess neither. With `namespaces=True` (the default) also
  mount (private tmpfs over /tmp, /var/tmp and /dev/shm, so world-writable places the code could
  write to vanish with it) and pid (a fresh /proc: no other process, its command line or its
  signals are reachable, and every process dies with the sandbox's first) — as root directly, as
  another user inside a user namespace (unprivileged kernels allow it).
- Fallback where no network namespace can be made at all (documented, weaker): an audit hook in
  the sandboxed interpreter refuses sockets and new processes (which the hook would not follow).
  It stops ordinary code, not a determined escape (ctypes can bypass it); `isolation["network"]`
  is then "audit-hook", and tests that need real isolation say so.
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
import uuid
from pathlib import Path
from typing import Annotated

import msgspec

NOBODY = 65534
INTERPRETERS = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
"""Python interpreters the code may run under, first one that user `nobody` may execute (as root)."""


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
    total_memory_mb: Annotated[int, msgspec.Meta(ge=32)] = 1024
    """Memory of all the call's processes together (a cgroup, where one can be made; else each
    process has `memory_mb` and the total is up to `memory_mb * max_processes`)."""


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


class _Cgroup:
    """A memory and pids cgroup for one call, where this process may make one (root, cgroup v1 or
    v2 with those controllers): a bound on the whole call's memory and processes (rlimits bound
    each process only), and the list of every process it made, setsid or not, to kill at the end."""

    ROOT = "/sys/fs/cgroup"

    def __init__(self, limits: SandboxLimits) -> None:
        self.dirs: list[str] = []
        name = f"slime-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        memory, pids = str(limits.total_memory_mb * 2**20), str(limits.max_processes)
        v2 = os.path.join(self.ROOT, "cgroup.controllers")
        try:
            if os.path.exists(v2) and {"memory", "pids"} <= set(Path(v2).read_text().split()):
                self._make(os.path.join(self.ROOT, name), {"memory.max": memory, "memory.swap.max": "0",
                                                           "pids.max": pids})
            elif os.path.isdir(os.path.join(self.ROOT, "memory")) and os.path.isdir(os.path.join(self.ROOT, "pids")):
                self._make(os.path.join(self.ROOT, "memory", name), {"memory.limit_in_bytes": memory})
                self._make(os.path.join(self.ROOT, "pids", name), {"pids.max": pids})
        except OSError:  # not root, or no such controller: rlimits only (SandboxResult.isolation says so)
            self.remove()

    def _make(self, path: str, settings: dict[str, str]) -> None:
        os.mkdir(path)
        self.dirs.append(path)
        for key, value in settings.items():
            if os.path.exists(os.path.join(path, key)):
                with open(os.path.join(path, key), "w") as f:
                    f.write(value)

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for path in self.procs:
            with contextlib.suppress(OSError):
                out |= {int(x) for x in Path(path).read_text().split()}
        return out

    async def kill_all(self, poll_s: float = 0.01, give_up_s: float = 10.0) -> None:
        """SIGKILL every process of the call (those that left its process group too), until none is left."""
        for _ in range(int(give_up_s / poll_s)):
            alive = self.pids()
            if not alive:
                return
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(poll_s)  # killed processes take a moment to exit and be reaped

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        self.dirs = []


async def _run(workdir: str, limits: SandboxLimits, stdin: str, namespaces: bool) -> SandboxResult:
    cgroup = _Cgroup(limits)
    try:
        return await _run_in(workdir, limits, stdin, namespaces, INTERPRETERS, cgroup)
    finally:
        await cgroup.kill_all()
        cgroup.remove()


async def _run_in(workdir: str, limits: SandboxLimits, stdin: str, namespaces: bool, pythons: list[str],
                  cgroup: _Cgroup) -> SandboxResult:
    config = msgspec.json.encode(
        {"workdir": workdir, "limits": limits, "pythons": pythons, "namespaces": namespaces, "cgroups": cgroup.procs}
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
        # The call ends when its first process does. `proc.wait()` would also wait for the output
        # pipes to close, which a process that left the group (setsid) keeps open: its returncode
        # is looked at instead (a 5 s limit once took 78.5 s)
        waiter = asyncio.ensure_future(proc.wait())
        deadline = asyncio.get_running_loop().time() + limits.wall_s
        while proc.returncode is None and not waiter.done():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                timed_out = True
                break
            await asyncio.wait({waiter}, timeout=min(left, 0.05))
        waiter.cancel()
    finally:
        # Always, also on cancellation: no process of the sandbox outlives this call.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        await cgroup.kill_all()  # what left the process group (setsid) is still in the cgroup
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
for procs in cfg["cgroups"]:  # first of all: every process it makes is counted, and killed at the end
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
iso = {"network": "audit-hook", "mount": "none", "pid": "none", "user": "unchanged",
       "cgroup": "memory+pids" if cfg["cgroups"] else "none"}
# the network is closed in every mode; `namespaces` adds the mount and pid namespaces
if cfg["namespaces"] and libc.unshare(NEWNET | NEWNS | NEWPID) == 0:
    iso.update(network="namespace", mount="namespace", pid="namespace")
elif cfg["namespaces"] and libc.unshare(NEWUSER | NEWNET | NEWNS | NEWPID) == 0:
    # not root (the usual cluster case): the same walls inside a user namespace
    iso.update(network="user-namespace", mount="namespace", pid="namespace")
    uid, gid = os.getuid(), os.getgid()  # mapped to themselves: files it makes need a mapped owner
    for name, text in (("uid_map", "%d %d 1" % (uid, uid)), ("setgroups", "deny"), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
elif libc.unshare(NEWNET) == 0:
    iso.update(network="namespace")
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
    if python is None:  # never run model code as root
        sys.stderr.write("sandbox: refusing to run model code as root: no Python interpreter that user nobody "
                         "may run (tried " + ", ".join(cfg["pythons"]) + "); install python3 for all users\n")
        os._exit(126)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    iso["user"] = "nobody"
python = python or sys.executable
sys.stderr.write("\x00sandbox-isolation " + json.dumps(iso) + "\n"); sys.stderr.flush()
env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
runner = (
    "import os, sys, runpy\n"
    "if sys.argv[1] == 'audit-hook':\n"
    "    def _hook(event, args):\n"
    "        if event.startswith(('socket.', 'urllib.')):\n"
    "            raise PermissionError('network access is not allowed in the sandbox')\n"
    "        if event in ('subprocess.Popen', 'os.exec', 'os.posix_spawn', 'os.spawn', 'os.system', 'os.fork',\n"
    "                     'os.forkpty', 'ctypes.dlopen'):\n"
    "            raise PermissionError('no new processes without a network namespace (the hook would not follow)')\n"
    "    sys.addaudithook(_hook)\n"
    "del sys.argv[1]\n"
    "sys.path.insert(0, os.getcwd())\n"
    "runpy.run_path('main.py', run_name='__main__')\n"
)
os.execve(python, [python, "-I", "-c", runner, iso["network"]], env)
"""
