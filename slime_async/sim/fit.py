"""Cost models and workloads fitted from this project's measurements, each with its error.

Sources: `benchmarks/results/*.json` (engine decode curves on CPU and on the H200, trainer and
Megatron step times, update pauses, transport) and a run's own files (`runs/NAME/summary.json`,
`rollout-0.json`: generation lengths, turns, tool calls, rewards, step times). Every fitted figure
comes back as a `FitLine` saying where it came from and how well the model reproduces it, so that
the CLI and the bench can print them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_async.sim.costs import DecodeCost
from slime_async.sim.workload import Lengths, Workload

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class FitLine:
    """One fitted figure: what, its value, its source, and the model's error against the data (or a note)."""

    what: str
    value: str
    source: str
    error: str


def load_result(name: str, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """A stored benchmark result; one clear error naming the file when it is missing or broken."""
    path = Path(results_dir) / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no stored result; run `slime-async bench {name}` first") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def decode_points(result: dict[str, Any], case_prefix: str, column: int = 2) -> tuple[tuple[float, float], ...]:
    """(concurrency, total tok/s) from an engine bench's `decode tok/s` rows whose case starts with
    `case_prefix` (e.g. 'tiny, concurrency' in engine.json)."""
    points = []
    for row in result["rows"]:
        if row[0] == "decode tok/s" and str(row[1]).startswith(case_prefix):
            points.append((float(str(row[1]).rsplit(" ", 1)[-1]), float(row[column])))
    if len(points) < 2:
        raise ValueError(f"benchmark {result.get('benchmark')}: fewer than 2 'decode tok/s' rows for {case_prefix!r}")
    return tuple(sorted(points))


def leave_one_out_error(points: tuple[tuple[float, float], ...]) -> float:
    """Largest relative error of the decode interpolation at each interior point, fitted without it."""
    worst = 0.0
    for i in range(1, len(points) - 1):
        rest = points[:i] + points[i + 1:]
        b, rate = points[i]
        predicted = DecodeCost(rest, max_batch=int(b)).tokens_per_s(int(b))
        worst = max(worst, abs(predicted / rate - 1))
    return worst


def success_p_for_filter(fraction: float, group_size: int) -> float:
    """The per-episode success probability p >= 0.5 at which a group of `group_size` has all-equal rewards
    (p^n + (1-p)^n) with probability `fraction`: independent rewards that the equal-rewards filter drops
    as often as it did in the run."""
    floor = 2 * 0.5 ** group_size
    if fraction <= floor:
        return 0.5
    lo, hi = 0.5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid ** group_size + (1 - mid) ** group_size < fraction:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def read_run_dir(run_dir: Path) -> dict[str, Any]:
    """A run directory's summary with its rollout stats and step records (`runs/NAME`)."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no summary.json; is it a finished `slime-async train` run directory?")
    summary = json.loads(path.read_text())
    rollouts = sorted(run_dir.glob("rollout-*.json"))
    if rollouts and not summary.get("rollout"):
        summary["rollout"] = [json.loads(p.read_text()) for p in rollouts]
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        summary["records"] = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return summary


def workload_from_run(summary: dict[str, Any], tool_latency: Lengths, group_size: int, max_new_tokens: float,
                      completion_sigma: float = 0.5) -> tuple[Workload, list[FitLine]]:
    """Episodes as a run saw them: turns and tokens per episode from its rollout stats, prompt and tool
    response sizes from its held-out checks, rewards from how often the equal-rewards filter dropped
    a group. What the run did not record is assumed and said so: the spread of reply lengths
    (lognormal, sigma `completion_sigma`, capped at `max_new_tokens`) and the tool latency given."""
    rollouts = summary.get("rollout") or []
    if not rollouts:
        raise ValueError("run summary: no rollout stats ('rollout'); cannot fit generation lengths")
    episodes = sum(r["episodes"] for r in rollouts)
    rate = sum(r["episodes_per_s"] for r in rollouts)
    turns = sum(r["turns_per_s"] for r in rollouts) / rate
    tokens = sum(r["tokens_per_s"] for r in rollouts) / rate
    groups_eq = sum(r.get("groups_dropped", {}).get("equal_rewards", 0) for r in rollouts)
    groups = sum(r["groups_sent"] + sum(r.get("groups_dropped", {}).values()) for r in rollouts)
    fraction = groups_eq / groups if groups else 0.0
    per_turn = tokens / turns
    before = (summary.get("success_before") or {}).get("greedy_metrics") or {}
    after = (summary.get("success_after") or {}).get("sampled_metrics") or {}
    prompt = before.get("metric/total_tokens", 0.0) - before.get("metric/completion_tokens", 0.0)
    calls = after.get("metric/tool_calls", 0.0)
    response = ((after.get("metric/total_tokens", 0.0) - after.get("metric/completion_tokens", 0.0) - prompt) / calls
                if calls else 0.0)
    median = per_turn / math.exp(completion_sigma ** 2 / 2)
    w = Workload(prompt_tokens=max(prompt, 0.0), completion_tokens=Lengths(median, completion_sigma, max_new_tokens),
                 tool_calls_mean=max(turns - 1, 0.0), tool_latency_s=tool_latency,
                 tool_response_tokens=max(response, 0.0), success_p=success_p_for_filter(fraction, group_size))
    lines = [
        FitLine("turns / episode", f"{turns:.2f}", f"rollout stats, {episodes} episodes", "exact (mean)"),
        FitLine("completion tokens / turn", f"{per_turn:.1f} (mean)", "rollout stats",
                f"{w.completion_tokens.mean() / per_turn - 1:+.1%} after the cap at {max_new_tokens:.0f}"),
        FitLine("prompt / tool-response tokens", f"{w.prompt_tokens:.0f} / {w.tool_response_tokens:.0f}",
                "held-out checks (greedy before, sampled after)", "means"),
        FitLine("group filtered (equal rewards)", f"{fraction:.1%} -> p = {w.success_p:.3f}", "rollout stats",
                "exact (independent rewards assumed)"),
    ]
    return w, lines
