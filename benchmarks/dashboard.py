"""The dashboard on a run of 100,000 trajectories: how long it takes to open, page, filter and show one.

A run directory is made with the recorder's own writer (`TrajectoryWriter`, the tiny model's tokenizer):
calculator-sized trajectories (a tool call and an answer, ~70 tokens), 32 per step, with their
`metrics.jsonl`. The real server is started on it (aiohttp on a free loopback port) and each request
is timed over real HTTP (median of several); with Chromium installed, the page itself is timed too:
from navigation to the first page of trajectories shown, and to the charts drawn.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks import Result
from slime_async.types import StopReason, Trajectory, Turn

DESCRIPTION = "dashboard load time on a run of 100,000 trajectories (open, page, filter, one trajectory)"
BATCH = 32


def _trajectories(tok: Any, step: int, rng: np.random.Generator) -> list[Trajectory]:
    out = []
    for g in range(BATCH // 8):
        a, b, c = (int(x) for x in rng.integers(10, 99, 3))
        task = f"{step}-{g}"
        prompt = tok.encode(f"<|im_start|>user\nWhat is {a}*{b}+{c}?<|im_end|>\n<|im_start|>assistant\n")
        for i in range(8):
            right = bool(rng.random() < 0.6)
            call = tok.encode(f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a}*{b}+{c}"}}}}'
                              "</tool_call><|im_end|>")
            result = tok.encode(f"\n<|im_start|>user\n<tool_response>{a * b + c}</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\n")
            answer = tok.encode(f"The answer is {a * b + c if right else a * b}.<|im_end|>")
            v = max(0, step - int(rng.integers(0, 3)))
            turns = [Turn(prompt_ids=prompt, completion_ids=call, logprobs=-rng.random(len(call)),
                          versions=[v] * len(call)),
                     Turn(prompt_ids=result, completion_ids=answer, logprobs=-rng.random(len(answer)),
                          versions=[v] * len(answer))]
            out.append(Trajectory(task_id=task, group_id=f"g{task}", sample_index=i, turns=turns,
                                  stop_reason=StopReason.DONE if rng.random() < 0.9 else StopReason.TRUNCATED,
                                  reward=float(right), rewards={"correct": float(right)},
                                  env="envs.calculator:CalculatorEnv"))
    return out


def make_run(run: Path, n: int) -> dict[str, float]:
    """A run directory with `n` trajectories in its store; returns the writer's cost."""
    from transformers import AutoTokenizer

    from slime_async.dashboard.store import TrajectoryWriter
    from slime_async.models.tiny_model import cached_model_dir
    from slime_async.train.recorder import advantages_of

    tok = AutoTokenizer.from_pretrained(str(cached_model_dir("tiny", seed=0)))
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: bench}\n")
    rng = np.random.default_rng(0)
    writer = TrajectoryWriter(run, tok)
    spent = []
    with (run / "metrics.jsonl").open("w") as metrics:
        for step in range(1, n // BATCH + 1):
            batch = _trajectories(tok, step, rng)
            began = time.perf_counter()
            writer.append(step, batch, advantages_of(batch, "grpo"))
            spent.append(time.perf_counter() - began)
            metrics.write(json.dumps({"version": step, "time": 1e9 + step, "elapsed_s": float(step),
                                      "reward_mean": sum(t.reward for t in batch) / BATCH, "seconds": 1.0,
                                      "trajectories": BATCH, "tokens": 2000, "publish_s": 0.1,
                                      "max_staleness": 2}) + "\n")
    writer.close()
    size = sum(p.stat().st_size for p in run.glob("trajectories.sqlite*"))
    return {"write_ms_per_step": 1e3 * statistics.median(spent), "store_mb": size / 1e6}


async def _time(http: aiohttp.ClientSession, url: str, repeats: int) -> tuple[float, Any]:
    times, body = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        async with http.get(url) as r:
            assert r.status == 200, (url, r.status, await r.text())
            body = await r.json()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times), body


async def _requests(run: Path, repeats: int) -> tuple[list[list[Any]], str]:
    from slime_async.dashboard.run_view import open_runs
    from slime_async.dashboard.server import Dashboard, start

    began = time.perf_counter()
    runner, url = await start(Dashboard(open_runs([run])), "127.0.0.1", 0)
    rows: list[list[Any]] = [["server start (reads metrics.jsonl)", 1e3 * (time.perf_counter() - began), ""]]
    api = url + "api/runs/0/"
    try:
        async with aiohttp.ClientSession() as http:
            first_ms, _ = await _time(http, api + "snapshot", 1)
            rows.append(["first snapshot (every chart's series)", first_ms, "cold"])
            for what, path in (("snapshot (polled every 2 s)", "snapshot"),
                               ("facets (filter choices)", "facets"),
                               ("first page: 50 newest", "trajectories?limit=50"),
                               ("page 2,000 (offset 99,950)", "trajectories?limit=50&offset=99950"),
                               ("filter: stop reason", "trajectories?stop_reason=truncated"),
                               ("filter: reward >= 1, by advantage", "trajectories?reward_min=1&sort=advantage"),
                               ("filter: steps 1000-1100", "trajectories?step_min=1000&step_max=1100"),
                               ("filter: task id", "trajectories?task_id=1500-2"),
                               ("text search (whole run)", "trajectories?text=What%20is%2042*"),
                               ):
                ms, body = await _time(http, api + path, repeats)
                n = body.get("total", body.get("count", "")) if isinstance(body, dict) else ""
                rows.append([what, ms, n])
            _, page = await _time(http, api + "trajectories?limit=1", 1)
            one = page["rows"][0]
            ms, body = await _time(http, api + f"trajectories/{one['id']}", repeats)
            rows.append(["one trajectory, token by token", ms, f"{body['tokens']} tokens"])
            ms, body = await _time(http, api + f"groups/{one['group_id']}", repeats)
            rows.append(["group view", ms, f"{len(body)} samples"])
    finally:
        await runner.cleanup()
    return rows, url


def _browser(run: Path) -> list[list[Any]]:
    """The page in Chromium: navigation to the first page of trajectories, and to the charts drawn."""
    import sys

    if not Path("/usr/bin/chromium").exists():
        return [["page in Chromium", None, "not installed (make browser)"]]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))
    from browser import canvases, chromium, serve, stop, wait  # the tests' own driver set-up
    from selenium.webdriver.common.by import By

    server, url, _ = serve(run, cwd=Path.cwd())
    driver = chromium()
    try:
        out = []
        for what, target, ready in (
                ("page: first 50 of the trajectories shown", url + "#trajectories",
                 lambda d: len(d.find_elements(By.CSS_SELECTOR, "[data-testid=row]")) == 50),
                ("page: every chart with data drawn", url, lambda d: canvases(d) >= 6)):
            times = []
            for _ in range(3):
                driver.get("about:blank")
                began = time.perf_counter()
                driver.get(target)
                wait(driver, ready, timeout=120, what=what)
                times.append(time.perf_counter() - began)
            out.append([what, 1e3 * statistics.median(times), "median of 3"])
        return out
    finally:
        driver.quit()
        stop(server)


def run(quick: bool = False) -> Result:
    n = 10_000 if quick else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "bench"
        began = time.perf_counter()
        written = make_run(run_dir, n)
        make_s = time.perf_counter() - began
        rows, _ = asyncio.run(_requests(run_dir, 3 if quick else 5))
        rows += _browser(run_dir)
    load = next(r[1] for r in rows if r[0].startswith("page: first 50"))
    worst = max(r[1] for r in rows if r[0].startswith(("filter", "text", "page 2", "first page", "one", "group")))
    headline = (f"{n:,} trajectories: the viewer's first page shows in {load / 1e3:.2f} s in Chromium (goal: usable, "
                f"< 2 s); the slowest API query {worst:.0f} ms; recording costs {written['write_ms_per_step']:.1f} ms "
                f"per step of {BATCH} (off the trainer's thread), {written['store_mb'] / n * 1e6 / 1e3:.1f} kB a "
                "trajectory") if isinstance(load, float) else f"{n:,} trajectories: slowest API query {worst:.0f} ms"
    return Result(columns=["what", "ms", "note"], rows=rows, headline=headline,
                  details={"trajectories": n, "build_s": make_s, **written})
