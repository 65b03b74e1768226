"""The code sandbox, with real subprocesses: escapes are tried and must fail. Each run is bounded
by its own small CPU and wall-clock limits, and hanging code never finishes by itself, so the
outcome does not depend on this machine's speed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import msgspec
import pytest

from slime_async.env import sandbox
from slime_async.env.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits and namespaces")
FAST = SandboxLimits(cpu_s=1, wall_s=5, memory_mb=256, file_size_mb=1, max_processes=16)


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_runs_code_with_files_and_stdin() -> None:
    code = "import helper, sys\nprint(helper.double(int(sys.stdin.read())))"
    r = await run_python(code, FAST, files={"helper.py": "def double(x):\n    return 2 * x\n"}, stdin="21")
    assert r.ok and r.stdout == "42\n" and r.stderr == ""
    assert gone(r.pgid)
    if os.geteuid() == 0:
        assert r.isolation == {"network": "namespace", "mount": "namespace", "pid": "namespace", "user": "nobody",
                               "cgroup": "memory+pids"}


async def test_failure_is_reported_not_raised() -> None:
    r = await run_python("raise SystemExit(3)", FAST)
    assert r.exit_code == 3 and not r.ok
    r = await run_python("1/0", FAST)
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr


async def test_no_network() -> None:
    connected = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = textwrap.dedent(f"""
        import socket
        for target in [("127.0.0.1", {port}), ("1.1.1.1", 80)]:
            try:
                socket.create_connection(target, timeout=1).close()
                print("connected", target)
            except OSError as exc:
                print("blocked", type(exc).__name__)
        try:
            socket.getaddrinfo("pypi.org", 443)
            print("resolved")
        except OSError as exc:
            print("blocked", type(exc).__name__)
    """)
    async with server:
        r = await run_python(code, FAST)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("blocked") == 3 and "connected" not in r.stdout and "resolved" not in r.stdout
    assert not connected.is_set()


async def test_fork_bomb_is_contained_and_cleaned_up() -> None:
    code = textwrap.dedent("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    r = await run_python(code, SandboxLimits(cpu_s=1, wall_s=2, max_processes=16))
    assert not r.ok
    assert gone(r.pgid)  # every process of the bomb is dead
    follow_up = await run_python("print('still fine')", FAST)
    assert follow_up.ok and follow_up.stdout == "still fine\n"


async def test_memory_bomb_fails_inside() -> None:
    r = await run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')", FAST)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


async def test_cannot_write_outside_its_directory() -> None:
    victim = Path(__file__).resolve().parent / f"victim-{uuid.uuid4().hex}.txt"  # not under /tmp: visible inside
    victim.write_text("original")
    host_tmp = Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}"
    repo_file = Path(__file__).resolve().parent / f"escape-{uuid.uuid4().hex}"
    # Only new files (removed below) and a file of the test's own: a broken sandbox must not
    # damage the machine that tests it.
    etc_file = Path("/etc") / f"sandbox-escape-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        for path in [{str(victim)!r}, {str(host_tmp)!r}, {str(repo_file)!r}, {str(etc_file)!r}]:
            try:
                with open(path, "a") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as exc:
                print("refused", type(exc).__name__)
        with open("mine.txt", "w") as f:
            f.write("ok")
        try:
            with open("big.bin", "wb") as f:
                f.write(b"x" * (2 * 1024 * 1024))
            print("big written")
        except OSError as exc:
            print("big refused", exc.strerror)
    """)
    try:
        r = await run_python(code, FAST)
        assert r.exit_code == 0, r.stderr
        assert victim.read_text() == "original"
        assert not host_tmp.exists() and not repo_file.exists() and not etc_file.exists()
        # refused: PermissionError, or FileNotFoundError when the checkout itself lies under /tmp (the
        # sandbox's /tmp is private, so the path does not exist in there); /tmp itself is writable
        refused = [line for line in r.stdout.splitlines() if line.startswith("refused ")]
        assert len(refused) == 3 and all(line.split()[1] in ("PermissionError", "FileNotFoundError")
                                         for line in refused)
        assert "big refused File too large" in r.stdout
    finally:
        for stray in (victim, host_tmp, repo_file, etc_file):
            stray.unlink(missing_ok=True)


async def test_infinite_loop_is_killed_by_cpu_limit() -> None:
    r = await run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=10))
    assert not r.ok
    assert r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) or r.timed_out
    assert gone(r.pgid)


async def test_sleeping_forever_is_killed_at_the_wall_clock() -> None:
    r = await run_python("import time\nprint('start', flush=True)\ntime.sleep(10_000)", SandboxLimits(wall_s=0.5))
    assert r.timed_out and r.exit_code is None and r.stdout == "start\n"
    assert gone(r.pgid)


async def test_output_flood_is_capped() -> None:
    r = await run_python("while True:\n    print('x' * 1000)", SandboxLimits(cpu_s=1, wall_s=1, max_output_bytes=5000))
    assert r.output_truncated and len(r.stdout) == 5000


async def test_cancellation_kills_the_sandbox() -> None:
    task = asyncio.ensure_future(run_python("import time\nprint('up', flush=True)\ntime.sleep(10_000)", FAST))
    # Wait until the sandboxed program is running: its process group appears under /proc.
    for _ in range(10_000):
        await asyncio.sleep(0.01)
        groups = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_sandbox(p)}
        if groups:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(gone(g) for g in groups)


def _is_sandbox(proc: Path) -> bool:
    try:
        return b"sandbox-isolation" in (proc / "cmdline").read_bytes() and os.getpgid(int(proc.name)) == int(proc.name)
    except (OSError, ProcessLookupError):
        return False


def test_file_names_cannot_leave_the_directory() -> None:
    with pytest.raises(ValueError, match="leaves the sandbox directory"):
        asyncio.run(run_python("", FAST, files={"../x.py": ""}))


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback's user switch needs root")
async def test_fallback_without_namespaces_still_contains(tmp_path: Path) -> None:
    """Without the mount and pid namespaces: the network is still closed (a namespace: a subprocess of
    the code once reached the engine on 127.0.0.1 past the audit hook), files refused by being
    `nobody`, bombs stopped by rlimits and the cgroup."""
    code = textwrap.dedent("""
        import os, socket, subprocess, sys
        for how in ("here", "a subprocess"):
            probe = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"
            try:
                if how == "here":
                    exec(probe)
                else:
                    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
                print("connected", how)
            except (OSError, subprocess.CalledProcessError):
                print("no network", how)
        try:
            open("/etc/sandbox-fallback-escape", "w")
            print("wrote")
        except PermissionError:
            print("refused")
        print(os.getuid())
    """)
    r = await run_python(code, FAST, namespaces=False)
    assert r.exit_code == 0, r.stderr
    assert r.isolation == {"network": "namespace", "mount": "none", "pid": "none", "user": "nobody",
                           "cgroup": "memory+pids"}
    assert r.stdout.splitlines() == ["no network here", "no network a subprocess", "refused", "65534"]
    Path("/etc/sandbox-fallback-escape").unlink(missing_ok=True)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = await run_python(bomb, SandboxLimits(cpu_s=1, wall_s=2, max_processes=16), namespaces=False)
    assert not r.ok and gone(r.pgid)


ESCAPER = textwrap.dedent("""
    import os, sys, time
    pid = os.fork()
    if pid == 0:
        os.setsid()  # out of the sandbox's process group
        time.sleep(10_000)
    print(pid, flush=True)
""")


@pytest.mark.parametrize("namespaces", [True, False])
async def test_a_process_that_leaves_the_process_group_ends_with_the_call(namespaces: bool) -> None:
    # once: a 5 s limit took 78.5 s (the escaped child held the output pipe) and the child outlived it
    r = await asyncio.wait_for(run_python(ESCAPER, SandboxLimits(wall_s=5), namespaces=namespaces), 120)
    assert r.exit_code == 0 and not r.timed_out, r.stderr
    if not namespaces:  # its pid is this machine's: it must be gone
        pid = int(r.stdout.split()[0])
        assert not Path(f"/proc/{pid}").exists() or "sleep" not in Path(f"/proc/{pid}/cmdline").read_text()
    assert not [d for d in Path("/sys/fs/cgroup/pids").glob("slime-sandbox-*")]  # its cgroup is gone too


@pytest.mark.skipif(os.geteuid() != 0, reason="the cgroup needs root here")
async def test_memory_is_bounded_for_all_processes_together() -> None:
    # rlimits bound each process: 8 children used 3 GB at memory_mb=512; the cgroup bounds the sum
    code = textwrap.dedent("""
        import os
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = bytearray(300 * 1024 * 1024)  # zeroed: every page is touched
                os._exit(0)
            kids.append(pid)
        print(sum(os.waitpid(k, 0)[1] == 0 for k in kids))
    """)
    r = await run_python(code, SandboxLimits(memory_mb=512, total_memory_mb=512, max_processes=16, wall_s=30))
    assert r.isolation["cgroup"] == "memory+pids", r.isolation
    assert r.exit_code == 0 and int(r.stdout) < 4, (r.stdout, r.stderr)  # some were stopped
    r = await run_python(code, SandboxLimits(memory_mb=512, total_memory_mb=2048, max_processes=16, wall_s=30))
    assert r.exit_code == 0 and int(r.stdout) == 4, (r.stdout, r.stderr)  # within the bound, all of them


async def test_other_processes_and_their_command_lines_are_not_visible() -> None:
    # once: the code read an engine's admin token from /proc/*/cmdline and killed its parent
    code = textwrap.dedent("""
        import os, signal
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        lines = [open(f"/proc/{p}/cmdline", "rb").read() for p in pids]
        print(len(pids), any(b"pytest" in line for line in lines))
        try:
            os.kill(os.getppid(), signal.SIGKILL)
            print("killed", os.getppid())
        except OSError as exc:
            print("refused", exc.errno)
    """)
    r = await run_python(code, FAST)
    assert r.isolation["pid"] == "namespace" and r.exit_code == 0, r.stderr
    count, seen = r.stdout.split("\n")[0].split()
    assert seen == "False" and int(count) <= 3  # the namespace's own: its init and the code


@pytest.mark.skipif(os.geteuid() != 0, reason="about running as root")
async def test_model_code_never_runs_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # once: where no interpreter was runnable by nobody, the code ran as root (read /etc/shadow)
    monkeypatch.setattr(sandbox, "INTERPRETERS", ["/root/no-such-python"])
    r = await run_python("print(open('/etc/shadow').read())", FAST)
    assert r.exit_code == 126 and r.stdout == ""
    assert "refusing to run model code as root: no Python interpreter that user nobody may run" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/python3").exists(),
                    reason="needs root to become another user, setpriv and a system python3")
def test_another_user_gets_the_same_walls_inside_a_user_namespace() -> None:
    # the usual cluster case: not root. The sandbox's own bootstrap, run as `nobody` (the parent side
    # needs this project's packages, which a system python3 lacks); once, such a run let the code
    # kill its parent and read another process's command line
    top = Path(tempfile.mkdtemp(prefix="sandbox-unprivileged-"))  # pytest's own tmp is root's alone
    work = top / "work"
    work.mkdir()
    (work / "main.py").write_text(textwrap.dedent("""
        import os, socket
        print(len([p for p in os.listdir("/proc") if p.isdigit()]))
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
            print("network")
        except OSError:
            print("no network")
        print(os.listdir("/tmp"))
    """))
    config = {"workdir": str(work), "limits": msgspec.to_builtins(FAST), "pythons": ["/usr/bin/python3"],
              "namespaces": True, "cgroups": []}
    for path in (top, work, work / "main.py"):
        os.chown(path, 65534, 65534)
    try:
        done = subprocess.run(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                               "/usr/bin/python3", "-I", "-S", "-c", sandbox._BOOTSTRAP, json.dumps(config)],
                              capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    status = done.stderr.partition("\n")[0]
    assert done.returncode == 0, done.stderr
    assert json.loads(status.split(" ", 1)[1]) == {"network": "user-namespace", "mount": "namespace",
                                                   "pid": "namespace", "user": "unchanged", "cgroup": "none"}
    assert done.stdout.splitlines() == ["1", "no network", "['sandbox']"]  # itself alone; a private /tmp
