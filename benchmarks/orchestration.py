"""Orchestration overhead: slime_async's scheduler against verifiers 0.3.1, same server, same task.

A minimal server (`benchmarks/minimal_server.py`, its own process) answers at once with the same
two replies on both protocols: a `calculate` call, then the final answer. slime_async drives the
calculator env over SGLang's `/generate` (token ids; its renderer applies the chat template
client-side); verifiers' ToolEnv drives its equivalent over `/v1/chat/completions` (the template
is the server's job there). Each side runs E episodes with concurrency C in its own process;
turns/s is wall-clock, turns per CPU-second is that process's own CPU time (the scheduler's cost
per turn). verifiers runs from `.venv-verifiers` (made on first use: `pip install verifiers==0.3.1`).

The last case is 10,000 concurrent episodes in one slime_async process (peak RSS reported). verifiers
is skipped there, with the reason printed, when its own turns/s at the previous concurrency says it
would take over `VERIFIERS_BUDGET_S`.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import Result

DESCRIPTION = "orchestration: turns/s and scheduler CPU per turn vs verifiers 0.3.1 ToolEnv, same instant server"
REPO = Path(__file__).resolve().parents[1]
VERIFIERS_VENV = REPO / ".venv-verifiers"
VERIFIERS_BUDGET_S = 180.0


def _verifiers_python() -> Path:
    python = VERIFIERS_VENV / "bin" / "python"
    if not python.exists():
        print("installing verifiers 0.3.1 into .venv-verifiers (once, ~2 min) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VERIFIERS_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "verifiers==0.3.1"], check=True)
    return python


async def _ours(url: str, tokenizer, episodes: int, concurrency: int) -> dict[str, float]:
    from slime_async.env import EnvFactory, Sampling
    from slime_async.rollout import ListSink, Scheduler, SGLangClient

    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {"num_train": episodes})
    sink = ListSink()
    async with SGLangClient([url], max_connections=1024) as client:
        scheduler = Scheduler(factory, factory.tasks("train"), client, tokenizer, sink, group_size=1,
                              batch_size=10**9, max_staleness=0, max_concurrency=concurrency,
                              sampling=Sampling(max_new_tokens=64), filter_equal_rewards=False)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        stats = await scheduler.run(num_groups=episodes)
        wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    assert stats.balanced() and stats.sent == episodes, stats.summary()
    turns = sum(len(t.turns) for g in sink.groups for t in g)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"episodes": episodes, "turns": turns, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": peak_rss_mb}


def _theirs(python: Path, url: str, episodes: int, concurrency: int) -> dict[str, float]:
    done = subprocess.run([str(python), str(Path(__file__).with_name("verifiers_driver.py")), url, str(episodes),
                           str(concurrency)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"verifiers driver failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> Result:
    from transformers import AutoTokenizer

    from slime_async.launch.process import start_process
    from slime_async.models.tiny_model import cached_model_dir

    model_dir = cached_model_dir("tiny")
    python = _verifiers_python()
    server = start_process("minimal server", [sys.executable, "-m", "benchmarks.minimal_server", "--model",
                                              str(model_dir)], r"serving on (http://\S+)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows, details = [], {}
    cases = [(1, 50), (100, 400), (10000, 10000)] if quick else [(1, 200), (100, 2000), (1000, 5000), (10000, 10000)]
    load_before = os.getloadavg()
    try:
        for concurrency, episodes in cases:
            ours = asyncio.run(_ours(server.url, tokenizer, episodes, concurrency))
            details[concurrency] = {"slime_async": ours}
            rows.append(_row(concurrency, "slime_async", ours))
            skip = _skip_verifiers(details, episodes, ours["turns"])
            if skip:
                print(f"verifiers 0.3.1 at concurrency {concurrency:,}: skipped ({skip})", flush=True)
                details[concurrency]["verifiers_skipped"] = skip
                rows.append([concurrency, "verifiers 0.3.1", episodes, "-", "-", "-", "skipped (see details)"])
                continue
            theirs = _theirs(python, server.url, episodes, concurrency)
            details[concurrency]["verifiers"] = theirs
            rows.append(_row(concurrency, "verifiers 0.3.1", theirs))
    finally:
        server.stop()
    both = max(c for c, d in details.items() if "verifiers" in d)
    ours, theirs = details[both]["slime_async"], details[both]["verifiers"]
    ratio = (ours["turns"] / ours["wall_s"]) / (theirs["turns"] / theirs["wall_s"])
    top = max(details)
    per_core = {c: d["slime_async"]["turns"] / d["slime_async"]["cpu_s"] for c, d in details.items()}
    headline = (f"turns/s ratio vs verifiers at concurrency {both:,}: {ratio:.2f} (goal 3); "
                f"turns per scheduler CPU-second: {per_core[both]:,.0f} at concurrency {both:,}, "
                f"{per_core[top]:,.0f} at {top:,} (goal 5,000); concurrent episodes in one process: {top:,}, "
                f"peak RSS {details[top]['slime_async']['peak_rss_mb']:,.0f} MB (goal 10,000)")
    columns = ["concurrency", "orchestrator", "episodes", "turns", "turns/s", "turns/CPU-s", "CPU us/turn"]
    out = {str(k): v for k, v in details.items()}
    out["load_avg_1_5_15"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return Result(columns=columns, rows=rows, headline=headline, details=out)


def _row(concurrency: int, name: str, r: dict[str, float]) -> list:
    return [concurrency, name, r["episodes"], r["turns"], r["turns"] / r["wall_s"], r["turns"] / r["cpu_s"],
            1e6 * r["cpu_s"] / r["turns"]]


def _skip_verifiers(details: dict[int, dict], episodes: int, turns: int) -> str:
    """Why verifiers is not run at this size ('' to run it): its own measured turns/s says it would
    take longer than the budget."""
    measured = [d["verifiers"] for d in details.values() if "verifiers" in d]
    if not measured:
        return ""
    rate = measured[-1]["turns"] / measured[-1]["wall_s"]
    estimate = turns / rate
    if estimate <= VERIFIERS_BUDGET_S:
        return ""
    return (f"{turns:,} turns at its measured {rate:,.0f} turns/s would take ~{estimate:,.0f} s, "
            f"over the {VERIFIERS_BUDGET_S:.0f} s budget")
