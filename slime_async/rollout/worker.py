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
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from slime_async.agents.server import close_shared_server
from slime_async.config import load_config
from slime_async.config.engine_kinds import engine_kind
from slime_async.config.model_dir import resolve_model_path
from slime_async.data import build_envs, build_tasks, close_shared_remote_rewards, load_state, save_state
from slime_async.env import Sampling
from slime_async.moe.shape import replay_shape
from slime_async.rollout.client import SGLangClient
from slime_async.rollout.filters import load_group_filter
from slime_async.rollout.guard import Guard
from slime_async.rollout.scheduler import Scheduler
from slime_async.rollout.sinks import BufferSink, Sink
from slime_async.rollout.teacher import TeacherScorer, TeacherSink
from slime_async.rollout.vllm_client import engine_client

log = logging.getLogger("slime_async.rollout.worker")


NO_TOTALS: dict[str, Any] = {"started": 0, "sent": 0, "dropped": {}, "lost_in_flight": 0, "lives": 0}
"""A worker's books before its first life."""


def earlier_totals(path: Path) -> dict[str, Any]:
    """The books of this worker's earlier lives in the run (it was restarted, or the run resumed):
    what they started, sent and dropped, and the episodes still in flight at their last report, lost
    with them when they died (0 after a clean stop)."""
    try:
        last = json.loads(path.read_text())
        totals = last["totals"]
    except (OSError, json.JSONDecodeError, KeyError):
        return NO_TOTALS
    return {**totals, "lost_in_flight": totals["lost_in_flight"] + last.get("in_flight", 0)}


def write_stats(scheduler: Scheduler, path: Path, earlier: dict[str, Any] | None = None,
                teacher: TeacherScorer | None = None) -> None:
    """The scheduler's running figures as JSON, replaced atomically (the launcher's view reads it), with
    `totals` over the worker's lives in this run (the run's books: `earlier_totals`) and, when distilling,
    what the teacher scored (`distill`)."""
    tmp = path.with_suffix(".tmp")
    st = scheduler.stats
    recent = st.rewards[-256:]
    e = earlier or NO_TOTALS
    dropped = dict(e["dropped"])
    for reason, n in st.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    totals = {"started": e["started"] + st.started, "sent": e["sent"] + st.sent, "dropped": dropped,
              "lost_in_flight": e["lost_in_flight"], "lives": e["lives"] + 1}
    extra = {"distill": teacher.stats.summary(teacher.client)} if teacher is not None else {}
    tmp.write_text(json.dumps({**st.summary(), "in_flight": st.started - st.finished, "time": time.time(),
                               "concurrency": scheduler.concurrency(),
                               "recent_reward": sum(recent) / len(recent) if recent else None, "totals": totals,
                               **extra}))
    tmp.replace(path)


async def report_stats(scheduler: Scheduler, path: Path, earlier: dict[str, Any], teacher: TeacherScorer | None,
                       every_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(every_s)  # a reporting period, not a wait for a condition
        write_stats(scheduler, path, earlier, teacher)


def accepted_so_far(buffer: str, curve_dir: str | None) -> int | None:
    """What the run has accepted that counts against the staleness bound: the trajectories the buffer
    holds or the trainer trained (by its checkpoint). None when the buffer does not answer."""
    from slime_async.buffer import BufferClient

    with BufferClient(buffer, curve_dir=curve_dir) as client:
        try:
            m = client.metrics(timeout=10)
        except TimeoutError:
            log.warning("the buffer at %s did not say what it holds", buffer)
            return None
    return int(m["trained"]) + int(m["buffered"])


async def run_worker(config_path: str, buffer: str, engines: list[str], worker: int, num_workers: int,
                     groups: int | None, data_state: str | None = None, teachers: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from slime_async.transport import AsyncSender

    cfg = load_config(config_path)
    r = cfg.rollout
    # The config's `data:` section: the env's own train split by default, or a dataset (with a router
    # when rows choose their env); worker i of k takes every k-th task of each epoch.
    envs = build_envs(cfg)
    state = load_state(data_state) if data_state and Path(data_state).exists() else None
    tasks = build_tasks(cfg, envs, state=state, shard=(worker, num_workers))
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    kind = engine_kind(cfg.engine.kind)
    replay = replay_shape(model_dir, cfg.train.moe.routing_replay, None if kind.routed_experts else kind.label)
    sampling = Sampling.from_config(r.sampling)
    # Each worker admits its share of the batch, so that the workers together keep the global bound.
    batch_share = max(1, r.batch_size // num_workers)
    # A resumed run (or a restarted worker) counts what was accepted before it: without it the rule
    # admits (v + eta + 1) * B at once at version v (AReaL's issue #1388).
    accepted = (accepted_so_far(buffer, cfg.buffer.curve_dir) or 0) // num_workers

    async def recount() -> int:
        found = await asyncio.to_thread(accepted_so_far, buffer, cfg.buffer.curve_dir)
        return found // num_workers if found is not None else scheduler.budget.accepted
    d = cfg.train.distill
    teacher_urls = (teachers or d.urls) if cfg.train.distilling else []
    if cfg.train.distilling and not teacher_urls:
        raise SystemExit("train.distill.model is set but no teacher server was given (--teacher URL or "
                         "train.distill.urls)")
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            engine_client(cfg.engine.kind, engines, admin_token=cfg.engine.admin_token,
                          lora=cfg.train.lora is not None))
        sender = await stack.enter_async_context(
            AsyncSender(buffer, name=f"rollout-{worker}", curve_dir=cfg.buffer.curve_dir))
        sink: Sink = BufferSink(sender)
        teacher = None
        if teacher_urls:  # on-policy distillation: each group is scored by the teacher on its way
            teacher_client = await stack.enter_async_context(
                SGLangClient(teacher_urls, request_timeout=d.timeout_s, retries=d.retries))
            teacher = TeacherScorer(teacher_client, d.max_batch, d.max_in_flight)
            sink = TeacherSink(sink, teacher)
        stats_path = Path(cfg.run.dir) / cfg.run.name / f"rollout-{worker}.json"
        earlier = earlier_totals(stats_path)
        scheduler = Scheduler(
            envs, tasks, client, tokenizer, sink, group_size=r.group_size,
            batch_size=batch_share, max_staleness=r.max_staleness,
            max_concurrency=max(1, r.max_concurrency // num_workers),
            # a group of equal rewards still carries the teacher's per-token signal when distilling
            filter_equal_rewards=r.filter_equal_rewards and not cfg.train.distilling,
            sampling=sampling, accepted=accepted, recount=recount,
            guard=Guard.for_rollout(r.guard, batch_share, r.group_size), group_filter=load_group_filter(r),
            replay=replay, adaptive_concurrency=r.adaptive_concurrency,
            # the launcher reads the verdict from the stats file and ends the run: written at once
            on_verdict=lambda verdict: write_stats(scheduler, stats_path, earlier, teacher),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, scheduler.stop)
        print("READY", flush=True)
        reporter = asyncio.ensure_future(report_stats(scheduler, stats_path, earlier, teacher))
        try:
            stats = await scheduler.run(num_groups=groups)
        finally:
            reporter.cancel()
            write_stats(scheduler, stats_path, earlier, teacher)
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
    parser.add_argument("--teacher", action="append", default=None,
                        help="URL of a teacher server for train.distill (repeat; default: train.distill.urls)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(run_worker(args.config, args.buffer, args.engine, args.worker, args.num_workers,
                                    args.groups, args.data_state, args.teacher)))


if __name__ == "__main__":
    main()
