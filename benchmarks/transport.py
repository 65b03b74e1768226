"""Transport: 4k-token trajectories from 1-4 sender processes to a consumer, three ways side by side.

(a) `zmq`: this transport. AsyncSender processes -> the buffer server process (`python -m
    slime_async.buffer.server`, write-ahead log on local disk, groups of 8) -> a trainer-side
    BufferClient draining batches of 64 and reporting them trained. Also without the WAL.
(b) `ray`: verl's MessageQueue pattern. Producer actors `put` Trajectory objects into one async
    queue actor through Ray's object store (64 puts in flight per producer); the driver `get`s
    batches of 64. Needs `pip install 'slime-async[bench]'` (ray); without it the row says so.
(c) `http`: JSON over HTTP. aiohttp client processes POST each trajectory as JSON (arrays as lists,
    16 requests in flight per sender) to an aiohttp server that decodes it into a Trajectory.

Every sender runs for a fixed time, then waits for its outstanding items to be confirmed (acked,
put, answered 200). For this transport, trajectories/s counts what the trainer-side consumer
received: consumed / (its last batch - first start), after it drained every acked trajectory that
makes a whole batch. For Ray and HTTP it is confirmed / (last finish - first start) as before (Ray's
driver stops reading when the producers finish, so its consumer count is lower: the comparison is
conservative for this transport). MB/s counts the msgpack frame size of a trajectory (the payload,
the same for all).

`cpu us/traj` is CPU time (user + system, every thread, from /proc) of the buffer server, the
senders and the consumer's process during the run, per trajectory consumed: unlike trajectories/s,
it does not depend on what else the machine runs. Two `bound` rows say what this machine allows:
one raw pyzmq hop carrying the same frames (32 per message, no protocol, no WAL), and the WAL alone
(the same frames appended and written to the page cache). The pipeline needs two hops (sender ->
buffer -> trainer) and one WAL write per trajectory, so at best it moves 2 cores / (2 x hop + WAL)
CPU-seconds per GB; the headline quotes that ceiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks import Result
from slime_async.types import StopReason, Trajectory, Turn, to_msgpack

DESCRIPTION = "4k-token trajectories, 1-4 senders: this ZeroMQ transport vs a Ray actor queue vs JSON over HTTP"

PROMPT_TOKENS, COMPLETION_TOKENS = 512, 3584  # 4,096 tokens: ids, logprobs, versions (and the loss mask)
GROUP_SIZE = 8
BATCH = 64
GOAL_VS_RAY, GOAL_MB_S = 10.0, 1000.0
HOP_BATCH = 32  # frames per message in the bound rows, as AsyncSender sends them


def make_trajectory(sender: int) -> Trajectory:
    rng = np.random.default_rng(sender)
    return Trajectory(
        task_id="bench", group_id=f"s{sender}-g0", sample_index=0, stop_reason=StopReason.DONE,
        turns=[Turn(prompt_ids=rng.integers(0, 150_000, PROMPT_TOKENS),
                    completion_ids=rng.integers(0, 150_000, COMPLETION_TOKENS),
                    logprobs=-rng.random(COMPLETION_TOKENS).astype(np.float32),
                    versions=np.full(COMPLETION_TOKENS, 3))],
    )


def _nth(base: Trajectory, sender: int, k: int) -> Trajectory:
    """A distinct trajectory (own id, own group) sharing the base's arrays: no copy per item."""
    return msgspec.structs.replace(
        base, id=f"s{sender}-{k}", group_id=f"s{sender}-g{k // GROUP_SIZE}", sample_index=k % GROUP_SIZE
    )


# -- (a) this transport ----------------------------------------------------------------------------
def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process, or of `pid` on Linux."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _zmq_sender(endpoint: str, sender: int, start_at: float, seconds: float, out: Any) -> None:
    from slime_async.transport import AsyncSender

    async def run() -> tuple[int, float, float, float]:
        base = make_trajectory(sender)
        async with AsyncSender(endpoint, name=f"bench-{sender}") as s:
            while time.monotonic() < start_at:
                await asyncio.sleep(0.005)
            t0, cpu0 = time.monotonic(), _cpu_s()
            k = 0
            while time.monotonic() - t0 < seconds:
                for _ in range(GROUP_SIZE):
                    await s.send(_nth(base, sender, k))
                    k += 1
            await s.flush(120)
            return s.stats.acked, t0, time.monotonic(), _cpu_s() - cpu0

    out.put(asyncio.run(run()))


def _run_zmq(senders: int, seconds: float, wal: bool) -> dict[str, float]:
    from slime_async.buffer import BufferClient, ServerSettings
    from slime_async.config.schema import BufferConfig

    with tempfile.TemporaryDirectory(prefix="bench-wal-") as wal_dir:
        settings = ServerSettings(
            buffer=BufferConfig(endpoint="tcp://127.0.0.1:0", capacity=4096, sender_credits=128),
            group_size=GROUP_SIZE, max_staleness=10**9, wal_dir=wal_dir if wal else None,
        )
        server = subprocess.Popen(
            [sys.executable, "-m", "slime_async.buffer", msgspec.json.encode(settings).decode()],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            line = server.stdout.readline() if server.stdout else ""
            if not line.startswith("READY "):
                raise RuntimeError(f"buffer server did not start (exit {server.poll()})")
            endpoint = line.split()[1]
            consumed, last = [0], [0.0]
            stop = threading.Event()

            def consume() -> None:
                with BufferClient(endpoint, retry_s=1.0) as client:
                    while not stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            consumed[0] += client.get_batch(BATCH, timeout=0.2).num_trajectories
                            last[0] = time.monotonic()
                            client.set_version(0)

            consumer = threading.Thread(target=consume, daemon=True)
            consumer.start()
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            start_at = time.monotonic() + 1.5  # after every sender process has started and connected
            procs = [
                ctx.Process(target=_zmq_sender, args=(endpoint, i, start_at, seconds, out)) for i in range(senders)
            ]
            for proc in procs:
                proc.start()
            while time.monotonic() < start_at:
                time.sleep(0.005)
            cpu0 = _cpu_s(server.pid) + _cpu_s()
            results = [out.get(timeout=seconds + 180) for _ in procs]
            for proc in procs:
                proc.join(30)
            acked = sum(r[0] for r in results)
            deadline = time.monotonic() + 120  # the consumer drains what was acked (all but < 1 batch)
            while consumed[0] <= acked - BATCH and time.monotonic() < deadline:
                time.sleep(0.01)
            cpu = _cpu_s(server.pid) + _cpu_s() - cpu0 + sum(r[3] for r in results)
            stop.set()
            consumer.join(10)
        finally:
            server.terminate()
            server.wait(30)
    out_ = _summarise([r[:3] for r in results], consumed=consumed[0])
    elapsed = last[0] - min(r[1] for r in results)
    out_.update(acked=acked, traj_s=consumed[0] / elapsed if consumed[0] else 0.0,
                cpu_us=cpu / max(consumed[0], 1) * 1e6)
    return out_


# -- (b) Ray actor queue ---------------------------------------------------------------------------
def _run_ray(senders: int, seconds: float) -> dict[str, float] | str:
    try:
        import ray
    except ImportError:
        return "ray is not installed: pip install 'slime-async[bench]' (or pip install ray)"

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

    @ray.remote
    class MessageQueue:  # verl's pattern: one async actor holding a bounded queue of samples
        def __init__(self, maxsize: int) -> None:
            self.queue: asyncio.Queue[Trajectory] = asyncio.Queue(maxsize)

        async def put_sample(self, sample: Trajectory) -> None:
            await self.queue.put(sample)

        async def get_samples(self, n: int) -> list[Trajectory]:
            out = [await self.queue.get()]
            while len(out) < n and not self.queue.empty():
                out.append(self.queue.get_nowait())
            return out

    @ray.remote
    class Producer:
        def run(self, queue: Any, sender: int, start_at: float, secs: float) -> tuple[int, float, float]:
            base = make_trajectory(sender)
            while time.monotonic() < start_at:
                time.sleep(0.005)
            t0 = time.monotonic()
            inflight: list[Any] = []
            k = 0
            while time.monotonic() - t0 < secs:
                inflight.append(queue.put_sample.remote(_nth(base, sender, k)))
                k += 1
                if len(inflight) >= 64:
                    _, inflight = ray.wait(inflight, num_returns=1)
            ray.get(inflight)
            return k, t0, time.monotonic()

    queue = MessageQueue.options(max_concurrency=1000).remote(4096)
    producers = [Producer.remote() for _ in range(senders)]
    ray.get([p.__ray_ready__.remote() for p in producers])
    start_at = time.monotonic() + 0.5
    futures = [p.run.remote(queue, i, start_at, seconds) for i, p in enumerate(producers)]
    consumed = 0
    pending = futures
    while pending:
        consumed += len(ray.get(queue.get_samples.remote(BATCH)))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
    results = ray.get(futures)
    for p in [*producers, queue]:
        ray.kill(p)
    return _summarise(results, consumed=consumed)


# -- (c) JSON over HTTP ----------------------------------------------------------------------------
def _http_server(port_out: Any) -> None:
    from aiohttp import web

    from slime_async.types import from_json

    async def handle(request: web.Request) -> web.Response:
        from_json(await request.read(), Trajectory)
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/trajectory", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_out.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


def _http_sender(port: int, sender: int, start_at: float, seconds: float, out: Any) -> None:
    import aiohttp

    from slime_async.types import to_json

    async def run() -> tuple[int, float, float]:
        base = make_trajectory(sender)
        url = f"http://127.0.0.1:{port}/trajectory"
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < start_at:
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            done = 0

            async def worker(w: int) -> None:
                nonlocal done
                k = w
                while time.monotonic() - t0 < seconds:
                    body = to_json(_nth(base, sender, k))
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                        r.raise_for_status()
                    done += 1
                    k += 16

            await asyncio.gather(*(worker(w) for w in range(16)))
            return done, t0, time.monotonic()

    out.put(asyncio.run(run()))


def _run_http(senders: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    port_q, out = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_http_server, args=(port_q,), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=60)
        start_at = time.monotonic() + 1.5
        procs = [ctx.Process(target=_http_sender, args=(port, i, start_at, seconds, out)) for i in range(senders)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=seconds + 180) for _ in procs]
        for proc in procs:
            proc.join(30)
    finally:
        server.terminate()
        server.join(10)
    return _summarise(results, consumed=None)


# -- what this machine allows -----------------------------------------------------------------------
def _hop_sender(endpoint: str, seconds: float, out: Any) -> None:
    import zmq

    frame = to_msgpack(make_trajectory(0))
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    sock.connect(endpoint)
    cpu0, t0, n = _cpu_s(), time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        sock.send_multipart([frame] * HOP_BATCH, copy=False)
        n += HOP_BATCH
    sock.send(b"end")
    out.put((n, _cpu_s() - cpu0))
    sock.close(linger=-1)


def _bound_hop(seconds: float) -> dict[str, float]:
    """One raw pyzmq tcp loopback hop, another process to this one, the same frames, no protocol."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 8)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_hop_sender, args=(f"tcp://127.0.0.1:{port}", seconds, out))
    proc.start()
    received, started, cpu0 = 0, 0.0, 0.0
    while (msg := sock.recv_multipart()) != [b"end"]:  # bytes, as the buffer server receives them
        if not started:
            started, cpu0 = time.monotonic(), _cpu_s()
        received += len(msg)
    elapsed, cpu = time.monotonic() - started, _cpu_s() - cpu0
    sent, sender_cpu = out.get(timeout=60)
    proc.join(30)
    sock.close(linger=0)
    return {"trajectories": received, "traj_s": received / elapsed, "cpu_us": (cpu + sender_cpu) / sent * 1e6}


def _bound_wal(seconds: float) -> dict[str, float]:
    """The WAL alone: the same frames appended, committed every HOP_BATCH, to the page cache."""
    from slime_async.buffer.wal import RecordType, WriteAheadLog

    frame = to_msgpack(make_trajectory(0))
    with tempfile.TemporaryDirectory(prefix="bench-wal-") as wal_dir:
        wal = WriteAheadLog(wal_dir)
        cpu0, t0, n = _cpu_s(), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            for _ in range(HOP_BATCH):
                wal.append(RecordType.TRAJECTORY, frame)
            wal.commit()
            n += HOP_BATCH
        elapsed, cpu = time.monotonic() - t0, _cpu_s() - cpu0
        wal.close()
    return {"trajectories": n, "traj_s": n / elapsed, "cpu_us": cpu / n * 1e6}


# -- driver ----------------------------------------------------------------------------------------
def _summarise(results: list[tuple[int, float, float]], consumed: int | None) -> dict[str, float]:
    count = sum(r[0] for r in results)
    elapsed = max(r[2] for r in results) - min(r[1] for r in results)
    return {"trajectories": count, "seconds": elapsed, "traj_s": count / elapsed,
            "consumed": -1 if consumed is None else consumed}


def run(quick: bool = False) -> Result:
    seconds = 0.5 if quick else 3.0
    counts = (2,) if quick else (1, 2, 4)
    frame_mb = len(to_msgpack(make_trajectory(0))) / 1e6
    load_before = os.getloadavg()
    rows: list[list[Any]] = []
    best: dict[str, float] = {}
    cpu_us: dict[str, float] = {}
    ray_note = ""
    cases: list[tuple[str, Any]] = [
        ("zmq (this, WAL on)", lambda n: _run_zmq(n, seconds, wal=True)),
        ("zmq (this, no WAL)", lambda n: _run_zmq(n, seconds, wal=False)),
        ("ray actor queue", lambda n: _run_ray(n, seconds)),
        ("json over http", lambda n: _run_http(n, seconds)),
    ]
    try:
        for name, fn in cases:
            for n in counts:
                r = fn(n)
                if isinstance(r, str):
                    ray_note = r
                    rows.append([name, n, 0, 0.0, 0.0, "", r])
                    break
                note = "" if r["consumed"] < 0 else f"consumer got {int(r['consumed']):,}"
                if "acked" in r:
                    note = f"counted at the consumer; senders got {int(r['acked']):,} acks"
                count = int(r["consumed"]) if "acked" in r else int(r["trajectories"])
                cpu = r.get("cpu_us", "")
                rows.append([name, n, count, r["traj_s"], r["traj_s"] * frame_mb, cpu, note])
                if r["traj_s"] > best.get(name, 0.0):
                    best[name] = r["traj_s"]
                    if cpu:
                        cpu_us[name] = cpu
    finally:
        with contextlib.suppress(ImportError):
            import ray

            if ray.is_initialized():
                ray.shutdown()
    hop, wal = _bound_hop(seconds), _bound_wal(seconds)
    rows.append(["bound: raw pyzmq hop", 1, int(hop["trajectories"]), hop["traj_s"], hop["traj_s"] * frame_mb,
                 hop["cpu_us"], f"{HOP_BATCH} frames a message, both ends' CPU"])
    rows.append(["bound: WAL write", 1, int(wal["trajectories"]), wal["traj_s"], wal["traj_s"] * frame_mb,
                 wal["cpu_us"], "append + commit to the page cache, no fsync"])
    cpus = os.cpu_count() or 1
    ceiling_mb_s = cpus / ((2 * hop["cpu_us"] + wal["cpu_us"]) * 1e-6) * frame_mb
    load_after = os.getloadavg()
    ours = best.get("zmq (this, WAL on)", 0.0)
    ray_best = best.get("ray actor queue")

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if ray_best:
        vs_ray = f"{ours / ray_best:.1f}x Ray (goal >= {GOAL_VS_RAY:.0f}x: {verdict(ours / ray_best >= GOAL_VS_RAY)})"
    else:
        vs_ray = f"vs Ray: n/a ({ray_note})"
    mb_s = ours * frame_mb
    ours_cpu = cpu_us.get("zmq (this, WAL on)", 0.0)
    headline = (
        f"this transport (WAL on), best of {', '.join(map(str, counts))} senders, counted at the consumer: "
        f"{ours:,.0f} trajectories/s, {mb_s:,.0f} MB/s (goal >= {GOAL_MB_S:,.0f} MB/s: {verdict(mb_s >= GOAL_MB_S)}); "
        f"{vs_ray}; it costs {ours_cpu:,.0f} CPU-us a trajectory (all processes); the machine's ceiling for "
        f"2 hops + WAL is {ceiling_mb_s:,.0f} MB/s ({cpus} CPUs, hop {hop['cpu_us']:.0f} + hop + WAL "
        f"{wal['cpu_us']:.0f} CPU-us a trajectory); frame {frame_mb * 1e3:.1f} kB; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (other users' processes share the CPUs)"
    )
    return Result(
        columns=["transport", "senders", "trajectories", "trajectories/s", "MB/s", "cpu us/traj", "note"],
        rows=rows, headline=headline,
        details={"frame_bytes": int(frame_mb * 1e6), "seconds_per_case": seconds, "best_traj_s": best,
                 "cpu_us_per_traj": cpu_us, "bound_hop": hop, "bound_wal": wal, "ceiling_mb_s": ceiling_mb_s,
                 "loadavg_before": load_before, "loadavg_after": load_after},
    )
