"""A rollout worker process: one asyncio loop running the scheduler into the buffer, until told to stop.

`python -m slime_async.rollout.worker CONFIG_YAML --buffer ENDPOINT --engine URL [--engine URL ...]`
prints `READY` once its sender is connected, runs groups of the configured environment's train
split (cycling through it) and stops cleanly on SIGTERM/SIGINT: no new groups, running episodes end
as ABORTED at their next model call, everything sent is flushed to the buffer. The weight version
reaches it through the engines' answers (each `/generate` carries the version that served it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import sys
from collections.abc import Iterator

from slime_async.config import load_config
from slime_async.config.model_dir import resolve_model_path
from slime_async.env import EnvFactory, Sampling
from slime_async.rollout.client import SGLangClient
from slime_async.rollout.scheduler import Scheduler
from slime_async.rollout.sinks import BufferSink
from slime_async.types import Task

log = logging.getLogger("slime_async.rollout.worker")


def endless(factory: EnvFactory, seed: int) -> Iterator[Task]:
    """The train split, epoch after epoch (each epoch's order fixed by the env's own seed)."""
    for epoch in itertools.count():
        empty = True
        for task in factory.tasks("train"):
            empty = False
            yield task
        if empty:
            raise ValueError(f"env {factory.name}: the train split is empty (epoch {epoch})")


async def run_worker(config_path: str, buffer: str, engines: list[str], worker: int, num_workers: int,
                     groups: int | None) -> int:
    from transformers import AutoTokenizer

    from slime_async.transport import AsyncSender

    cfg = load_config(config_path)
    r = cfg.rollout
    factory = EnvFactory.from_config(cfg.env.name, cfg.env.args)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.path)))
    sampling = Sampling(temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                        max_new_tokens=r.sampling.max_new_tokens)
    # Each worker admits its share of the batch, so that the workers together keep the global bound.
    batch_share = max(1, r.batch_size // num_workers)
    async with SGLangClient(engines) as client, AsyncSender(buffer, name=f"rollout-{worker}",
                                                            curve_dir=cfg.buffer.curve_dir) as sender:
        sink = BufferSink(sender)
        scheduler = Scheduler(
            factory, endless(factory, cfg.run.seed), client, tokenizer, sink, group_size=r.group_size,
            batch_size=batch_share, max_staleness=r.max_staleness,
            max_concurrency=max(1, r.max_concurrency // num_workers),
            filter_equal_rewards=r.filter_equal_rewards, sampling=sampling,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, scheduler.stop)
        print("READY", flush=True)
        stats = await scheduler.run(num_groups=groups)
        await sink.close()
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(run_worker(args.config, args.buffer, args.engine, args.worker, args.num_workers,
                                    args.groups)))


if __name__ == "__main__":
    main()
