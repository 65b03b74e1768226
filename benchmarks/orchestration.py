"""Orchestration overhead: slime_async's scheduler against verifiers 0.3.1, same server, same task.

A minimal server (`benchmarks/minimal_server.py`, its own process) answers at once with the same
two replies on both protocols: a `calculate` call, then the final answer. slime_async drives the
calculator env over SGLang's `/generate` (token ids; its renderer applies the chat template
client-side); verifiers' ToolEnv drives its equivalent over `/v1/chat/completions` (the template
is the server's job there). Each side runs E episodes with concurrency C in its own process;
turns/s is wall-clock, turns per CPU-second is that process's own CPU time (the scheduler's cost
per turn). verifiers runs from `.venv-verifiers` (made on first use: `pip install verifiers==0.3.1`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import Result

DESCRIPTION = "orchestration: turns/s and scheduler CPU per turn vs verifiers 0.3.1 ToolEnv, same instant server"
REPO = Path(__file__).resolve().parents[1]
VERIFIERS_VENV = REPO / ".venv-verifiers"


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
    return {"episodes": episodes, "turns": turns, "wall_s": wall, "cpu_s": cpu}


def _theirs(python: Path, url: str, episodes: int, concurrency: int) -> dict[str, float]:
    done = subprocess.run([str(python), str(Path(__file__).with_name("verifiers_driver.py")), url, str(episodes),
                           str(concurrency)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"verifiers driver failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> Result:
    from transformers import AutoTokenizer

    from slime_async.launch.process import start_process
    from slime_async.train.tiny_model import cached_model_dir

    model_dir = cached_model_dir("tiny")
    python = _verifiers_python()
    server = start_process("minimal server", [sys.executable, "-m", "benchmarks.minimal_server", "--model",
                                              str(model_dir)], r"serving on (http://\S+)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows, details = [], {}
    cases = [(1, 50), (100, 400)] if quick else [(1, 200), (100, 2000), (1000, 5000), (10000, 10000)]
    try:
        for concurrency, episodes in cases:
            ours = asyncio.run(_ours(server.url, tokenizer, episodes, concurrency))
            theirs = _theirs(python, server.url, episodes, concurrency)
            details[concurrency] = {"slime_async": ours, "verifiers": theirs}
            for name, r in (("slime_async", ours), ("verifiers 0.3.1", theirs)):
                rows.append([concurrency, name, r["episodes"], r["turns"], r["turns"] / r["wall_s"],
                             r["turns"] / r["cpu_s"], 1e6 * r["cpu_s"] / r["turns"]])
    finally:
        server.stop()
    top = max(details)
    ours, theirs = details[top]["slime_async"], details[top]["verifiers"]
    ratio = (ours["turns"] / ours["wall_s"]) / (theirs["turns"] / theirs["wall_s"])
    per_core = ours["turns"] / ours["cpu_s"]
    headline = (f"turns/s ratio vs verifiers at concurrency {top}: {ratio:.2f} (goal 3); "
                f"turns per scheduler CPU-second: {per_core:,.0f} (goal 5,000); "
                f"concurrent episodes in one process: {top:,} (goal 10,000)")
    columns = ["concurrency", "orchestrator", "episodes", "turns", "turns/s", "turns/CPU-s", "CPU us/turn"]
    return Result(columns=columns, rows=rows, headline=headline, details={str(k): v for k, v in details.items()})
