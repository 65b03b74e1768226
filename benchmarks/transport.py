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
put, answered 200); trajectories/s = confirmed trajectories / (last finish - first start), all
senders together. MB/s counts the msgpack frame size of a trajectory (the payload, the same for all).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
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
def _zmq_sender(endpoint: str, sender: int, start_at: float, seconds: float, out: Any) -> None:
    from slime_async.transport import AsyncSender

    async def run() -> tuple[int, float, float]:
        base = make_trajectory(sender)
        async with AsyncSender(endpoint, name=f"bench-{sender}") as s:
            while time.monotonic() < start_at:
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            k = 0
            while time.monotonic() - t0 < seconds:
                for _ in range(GROUP_SIZE):
                    await s.send(_nth(base, sender, k))
                    k += 1
            await s.flush(120)
            return s.stats.acked, t0, time.monotonic()

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
            consumed = [0]
            stop = threading.Event()

            def consume() -> None:
                with BufferClient(endpoint, retry_s=1.0) as client:
                    while not stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            consumed[0] += client.get_batch(BATCH, timeout=0.2).num_trajectories
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
            results = [out.get(timeout=seconds + 180) for _ in procs]
            for proc in procs:
                proc.join(30)
            stop.set()
            consumer.join(10)
        finally:
            server.terminate()
            server.wait(30)
    return _summarise(results, consumed=consumed[0])


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
    rows: list[list[Any]] = []
    best: dict[str, float] = {}
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
                    rows.append([name, n, 0, 0.0, 0.0, r])
                    break
                rows.append([name, n, int(r["trajectories"]), r["traj_s"], r["traj_s"] * frame_mb,
                             "" if r["consumed"] < 0 else f"consumer got {int(r['consumed']):,}"])
                best[name] = max(best.get(name, 0.0), r["traj_s"])
    finally:
        with contextlib.suppress(ImportError):
            import ray

            if ray.is_initialized():
                ray.shutdown()
    ours = best.get("zmq (this, WAL on)", 0.0)
    ray_best = best.get("ray actor queue")
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if ray_best:
        vs_ray = f"{ours / ray_best:.1f}x Ray (goal >= {GOAL_VS_RAY:.0f}x: {verdict(ours / ray_best >= GOAL_VS_RAY)})"
    else:
        vs_ray = f"vs Ray: n/a ({ray_note})"
    mb_s = ours * frame_mb
    headline = (
        f"this transport (WAL on), best of {', '.join(map(str, counts))} senders: {ours:,.0f} trajectories/s, "
        f"{mb_s:,.0f} MB/s (goal >= {GOAL_MB_S:,.0f} MB/s: {verdict(mb_s >= GOAL_MB_S)}); {vs_ray}; "
        f"frame {frame_mb * 1e3:.1f} kB; {os.cpu_count()} CPUs shared by all processes"
    )
    return Result(
        columns=["transport", "senders", "trajectories", "trajectories/s", "MB/s", "note"],
        rows=rows, headline=headline,
        details={"frame_bytes": int(frame_mb * 1e6), "seconds_per_case": seconds, "best_traj_s": best},
    )
