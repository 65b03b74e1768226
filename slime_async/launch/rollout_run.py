"""`slime-async rollout`: the rollout side alone, against running or embedded engines, into a JSONL file."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from slime_async.agents.server import close_shared_server
from slime_async.config import Config
from slime_async.env import EnvFactory, Sampling
from slime_async.launch.local import engine_args, engine_env
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.rollout.errors import describe
from slime_async.rollout.guard import Guard, Verdict
from slime_async.rollout.scheduler import RolloutStats, Scheduler
from slime_async.rollout.sinks import JsonlSink
from slime_async.rollout.vllm_client import engine_client


def start_embedded_engines(cfg: Config, model_dir: Path) -> list[EngineProcess]:
    """`engine.num_engines` embedded engine processes on `model_dir`, as the config describes them."""
    procs: list[EngineProcess] = []
    try:
        for i in range(cfg.engine.num_engines):
            procs.append(start_engine(model_dir, *engine_args(cfg, i), env=engine_env(cfg)))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def rollout_to_file(cfg: Config, model_dir: Path, out: Path, groups: int, split: str,
                    console: Console | None = None, limits: list[int] | None = None) -> RolloutStats:
    """Run `groups` groups of the configured env and write every kept trajectory to `out`. `limits`, when
    given, gets the episodes-in-flight limit twice a second (with `rollout.adaptive_concurrency`, the
    one the engines' load set)."""
    return asyncio.run(_rollout(cfg, model_dir, out, groups, split, console or Console(), limits))


async def _rollout(cfg: Config, model_dir: Path, out: Path, groups: int, split: str, console: Console,
                   limits: list[int] | None) -> RolloutStats:
    from transformers import AutoTokenizer

    from slime_async.data import build_envs, build_tasks

    factory = build_envs(cfg)
    # the config's `data:` section when it names a dataset; else the env's own tasks of `split`
    tasks = build_tasks(cfg, factory) if cfg.data.source != "env" else EnvFactory.from_config(
        cfg.env.name, cfg.env.args).tasks(split)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engines: list[EngineProcess] = []
    urls = list(cfg.engine.urls)
    kind = cfg.engine.kind if urls else "embedded"  # attached servers, or embedded ones started here
    if not urls:
        with console.status(f"starting {cfg.engine.num_engines} embedded engine(s) on {model_dir} ..."):
            engines = await asyncio.to_thread(start_embedded_engines, cfg, model_dir)
        urls = [e.url for e in engines]
    sink = JsonlSink(out)
    r = cfg.rollout
    # Nothing trains here, so equal rewards are no reason to stop; episodes that mostly fail are.
    guard = Guard.for_rollout(msgspec.structs.replace(r.guard, on_no_signal="off"), r.batch_size, r.group_size)

    def on_verdict(verdict: Verdict) -> None:
        if verdict.action == "stop":
            scheduler.stop()

    try:
        async with engine_client(kind, urls, admin_token=cfg.engine.admin_token) as client:
            scheduler = Scheduler(
                factory, tasks, client, tokenizer, sink,
                group_size=r.group_size, batch_size=r.batch_size, max_staleness=r.max_staleness,
                # evaluation and data generation keep every group: filtering is for training
                max_concurrency=r.max_concurrency, filter_equal_rewards=False,
                sampling=Sampling.from_config(r.sampling), guard=guard, on_verdict=on_verdict,
                adaptive_concurrency=r.adaptive_concurrency,
            )
            # Rollout alone never trains, so nothing would ever raise the version: lift the bound.
            scheduler.budget.max_staleness = 1 << 30
            with Live(_table(scheduler, groups, out), console=console, refresh_per_second=2) as live:
                run = asyncio.ensure_future(scheduler.run(num_groups=groups))
                while not run.done():
                    await asyncio.wait({run}, timeout=0.5)
                    live.update(_table(scheduler, groups, out))
                    if limits is not None:
                        limits.append(scheduler.concurrency()["limit"])
                stats = run.result()
            console.print()
    finally:
        await sink.close()
        await close_shared_server()  # an agent env's endpoint, when it started one
        for e in engines:
            e.stop()
    return stats


def _table(scheduler: Scheduler, groups: int, out: Path) -> Table:
    stats = scheduler.stats
    s: dict[str, Any] = stats.summary()
    c = scheduler.concurrency()
    table = Table(title=f"rollout -> {out}", show_header=False)
    done = s["groups_sent"] + sum(s["groups_dropped"].values())
    table.add_row("groups", f"{done} / {groups} ({s['groups_sent']} written, dropped: {s['groups_dropped'] or 0})")
    table.add_row("episodes", f"{s['episodes']} ({s['episodes_per_s']:.1f}/s), turns {s['turns_per_s']:.1f}/s")
    table.add_row("tokens/s", f"{s['tokens_per_s']:.0f}")
    table.add_row("in flight", f"{c['in_flight']} episodes, limit {c['limit']}"
                  + (" (adaptive: from the engines' load)" if c["adaptive"] else " (rollout.max_concurrency)"))
    table.add_row("mean reward", f"{s['mean_reward']:.3f}")
    table.add_row("stop reasons", ", ".join(f"{k} {v}" for k, v in sorted(s["stop_reasons"].items())) or "-")
    for i, line in enumerate(describe(s["errors"])):
        table.add_row("[red]errors[/]" if i == 0 else "", f"[red]{escape(line)}[/]")
    table.add_row("elapsed", f"{time.monotonic() - stats.started_at:.1f} s")
    return table

