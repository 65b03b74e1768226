"""A rollout worker process: one asyncio loop running the scheduler into the buffer, until told to stop.

`python -m slime_async.rollout.worker CONFIG_YAML --buffer ENDPOINT --engine URL [--engine URL ...]`
prints `READY` once its sender is connected, runs groups of the tasks that the config's `data:`
section names (by default the environment's own train split, cycled; `--data-state FILE` resumes
the task stream from FILE and saves it there at exit) and stops cleanly on SIGTERM/SIGINT: no new
groups, running episodes end as ABORTED at their next model call, everything sent is flushed to the
buffer. The weight version reaches it through the engines' answers (each `/generate` carries the
version that served it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from slime_async.agents.server import close_shared_server
from slime_async.config import load_config
from slime_async.config.model_dir import resolve_model_path
from slime_async.data import build_envs, build_tasks, close_shared_remote_rewards, load_state, save_state
from slime_async.env import Sampling
from slime_async.rollout.client import SGLangClient
from slime_async.rollout.scheduler import Scheduler
from slime_async.rollout.sinks import BufferSink

log = logging.getLogger("slime_async.rollout.worker")


def write_stats(scheduler: Scheduler, path: Path) -> None:
    """The scheduler's running figures as JSON, replaced atomically (the launcher's view reads it)."""
    tmp = path.with_suffix(".tmp")
    st = scheduler.stats
    recent = st.rewards[-256:]
    tmp.write_text(json.dumps({**st.summary(), "in_flight": st.started - st.finished, "time": time.time(),
                               "recent_reward": sum(recent) / len(recent) if recent else None}))
    tmp.replace(path)


async def report_stats(scheduler: Scheduler, path: Path, every_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(every_s)  # a reporting period, not a wait for a condition
        write_stats(scheduler, path)


async def run_worker(config_path: str, buffer: str, engines: list[str], worker: int, num_workers: int,
                     groups: int | None, data_state: str | None = None) -> int:
    from transformers import AutoTokenizer

    from slime_async.transport import AsyncSender

    cfg = load_config(config_path)
    r = cfg.rollout
    # The config's `data:` section: the env's own train split by default, or a dataset (with a router
    # when rows choose their env); worker i of k takes every k-th task of each epoch.
    envs = build_envs(cfg)
    state = load_state(data_state) if data_state and Path(data_state).exists() else None
    tasks = build_tasks(cfg, envs, state=state, shard=(worker, num_workers))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.path)))
    sampling = Sampling.from_config(r.sampling)
    # Each worker admits its share of the batch, so that the workers together keep the global bound.
    batch_share = max(1, r.batch_size // num_workers)
    async with SGLangClient(engines, admin_token=cfg.engine.admin_token) as client, AsyncSender(
            buffer, name=f"rollout-{worker}", curve_dir=cfg.buffer.curve_dir) as sender:
        sink = BufferSink(sender)
        scheduler = Scheduler(
            envs, tasks, client, tokenizer, sink, group_size=r.group_size,
            batch_size=batch_share, max_staleness=r.max_staleness,
            max_concurrency=max(1, r.max_concurrency // num_workers),
            filter_equal_rewards=r.filter_equal_rewards, sampling=sampling,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, scheduler.stop)
        print("READY", flush=True)
        stats_path = Path(cfg.run.dir) / cfg.run.name / f"rollout-{worker}.json"
        reporter = asyncio.ensure_future(report_stats(scheduler, stats_path))
        try:
            stats = await scheduler.run(num_groups=groups)
        finally:
            reporter.cancel()
            write_stats(scheduler, stats_path)
        await sink.close()
        await close_shared_remote_rewards()
        await close_shared_server()  # the agent endpoint, when an agent env started one
    if data_state:
        save_state(tasks.state(), data_state)  # tasks still in flight at the stop are not replayed
    print(f"DONE sent={stats.sent} dropped={dict(stats.dropped)} balanced={stats.balanced()}", flush=True)
    return 0 if stats.balanced() else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime_async.rollout.worker")
    parser.add_argument("config")
    parser.add_argument("--buffer", required=True, help="ZeroMQ endpoint of the buffer server")
    parser.add_argument("--engine", action="append", required=True, help="URL of an engine (repeat)")
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--groups", type=int, default=None, help="stop after this many groups (default: never)")
    parser.add_argument("--data-state", default=None, help="JSON file: resume the task stream from it, save it at exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(run_worker(args.config, args.buffer, args.engine, args.worker, args.num_workers,
                                    args.groups, args.data_state)))


if __name__ == "__main__":
    main()
