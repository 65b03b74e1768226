"""`slime-async train`: a run directory, every part as a process (here, or under Ray actors with
`--ray`), a live view, a summary at the end.

The run directory `<run.dir>/<run.name>` holds the resolved config (`config.yaml`, what every part
reads), `logs/` (one file per part), `metrics.jsonl` (one line per trainer step, written by the
trainer), the buffer's WAL and the checkpoints. `--resume` continues a run from them; without it,
an existing run directory is refused rather than overwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from slime_async.config import Config, ConfigError, to_yaml
from slime_async.config.model_dir import resolve_model_path
from slime_async.launch.dashboard import start_dashboard, stop_dashboard
from slime_async.launch.local import LocalLauncher
from slime_async.launch.success_check import Success, check_success, measure_success
from slime_async.rollout.errors import describe as describe_errors
from slime_async.rollout.errors import merge as merge_errors
from slime_async.rundir.run_files import write_parts
from slime_async.rundir.run_log import append_event, read_events, read_jsonl
from slime_async.train.metrics_log import check_log_config


def prepare_run_dir(cfg: Config, resume: bool, overwrite: bool) -> tuple[Path, Path]:
    """Create (or reopen with `resume`) the run directory; write the resolved config. Returns both paths."""
    run_dir = Path(cfg.run.dir) / cfg.run.name
    if run_dir.exists() and any(run_dir.iterdir()) and not (resume or overwrite):
        raise ConfigError(f"run.name: {run_dir} already holds a run; pass --resume to continue it, "
                          "--overwrite to start over, or choose another run.name")
    if overwrite and not resume and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(to_yaml(cfg))
    return run_dir, config_path


def train(cfg: Config, resume: bool = False, overwrite: bool = False, console: Console | None = None,
          ray: str | None = None) -> dict:
    """Run the whole asynchronous loop until the trainer has done `train.steps` steps: warm-start (when
    enabled), the success check, RL, the success after, a summary. The parts run as processes here, or
    as Ray actors when `ray` is given (an address, or "" for `launch.ray.address` / Ray's discovery)."""
    console = console or Console()
    check_log_config(cfg.log)
    started = time.monotonic()
    if ray is None:  # here every part shares this machine's GPU; Ray places them by `launch.placement`
        _check_gpu_memory(cfg, console)
    run_dir, config_path = prepare_run_dir(cfg, resume, overwrite)
    dashboard = start_dashboard(cfg, run_dir, console)  # live from the start (log.dashboard)
    cfg, warm = _warm_start(cfg, console)
    config_path.write_text(to_yaml(cfg))  # every part reads the model RL starts from
    before = None
    before_path = run_dir / "success_before.json"
    if resume and before_path.exists():  # measured by the run's first attempt: kept, not measured again
        before = Success(**json.loads(before_path.read_text()))
    elif cfg.warmstart.check_tasks and not resume:
        with _status(console, f"measuring success on {cfg.warmstart.check_tasks} held-out problems ..."):
            before = asyncio.run(measure_success(cfg, None, cfg.warmstart.check_tasks))
        before_path.write_text(json.dumps(asdict(before)))
        console.print(f"success before RL: {before.sampled:.1%} sampled, {before.greedy:.1%} greedy "
                      f"({before.tasks} held-out problems)")
        check_success(cfg, before)
    if resume:
        append_event(run_dir, "the run was resumed (--resume)")
    launcher: LocalLauncher
    if ray is not None:
        from slime_async.launch.ray_launcher import RayLauncher

        launcher = RayLauncher(cfg, config_path, run_dir, address=ray or None)
    else:
        launcher = LocalLauncher(cfg, config_path, run_dir)
    rl_started = time.monotonic()
    where = "as Ray actors" if ray is not None else "as processes"
    with _status(console, f"starting buffer, engines, trainer and rollout workers {where} ..."):
        launcher.start(on_event=lambda message: console.print(f"[yellow]{message}[/]"))
    parts = launcher.describe()
    metrics_path = run_dir / "metrics.jsonl"
    try:
        with Live(_view(cfg, run_dir, rl_started), console=console, refresh_per_second=1) as live:
            def done() -> bool:
                live.update(_view(cfg, run_dir, rl_started))
                write_parts(run_dir, launcher.parts)  # each part's health, for the dashboard
                # a rollout worker's guard found a run that cannot learn: end it here, with the summary
                return stop_verdict(guard_verdicts(rollout_stats(run_dir))) is not None

            launcher.supervise(done)
        rl_s = time.monotonic() - rl_started
        launcher.stop_rollout()  # what the workers finished reaches the buffer before it is counted
        buffer_metrics = buffer_counts(launcher)
        after = None
        stopped = stop_verdict(guard_verdicts(rollout_stats(run_dir)))
        if cfg.warmstart.check_tasks and stopped is None:  # on the engines, which serve the final weights
            with _status(console, "measuring success after RL ..."):
                after = asyncio.run(measure_success(cfg, None, cfg.warmstart.check_tasks, urls=launcher.engine_urls))
    finally:
        launcher.shutdown()
        stop_dashboard(dashboard, run_dir, console)
    records = read_jsonl(metrics_path)
    evals = read_jsonl(run_dir / "eval.jsonl")
    workers = rollout_stats(run_dir)
    summary = {"steps": len(records), "wall_s": time.monotonic() - started, "rl_s": rl_s, "warmstart": warm,
               "success_before": asdict(before) if before else None,
               "success_after": asdict(after) if after else None, "parts": parts,
               "events": [e["event"] for e in read_events(run_dir)],  # every attempt's, with --resume
               "last": records[-1] if records else None, "buffer": buffer_metrics, "eval": evals,
               "max_staleness": max((r.get("max_staleness", 0) for r in records), default=None),
               "rollout": workers, "errors": merge_errors([w.get("errors", {}) for w in workers]),
               "guard": guard_verdicts(workers), "stopped": stopped,
               "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@contextlib.contextmanager
def _status(console: Console, text: str) -> Iterator[None]:
    """A spinner on a terminal; in a log file (where a spinner draws nothing) the line itself."""
    if console.is_terminal:
        with console.status(text):
            yield
    else:
        console.print(text)
        yield


def _check_gpu_memory(cfg: Config, console: Console) -> None:
    """On a GPU: say what each part will hold (`launch.memory_plan`), and refuse a run whose fixed parts
    alone cannot fit, before its warm-start and its parts spend minutes starting."""
    from slime_async.launch.memory_plan import GB, check_fits, gpu_total_bytes, plan_for

    if cfg.model.device == "cpu" or (gpu := gpu_total_bytes()) is None:
        return
    if cfg.model.device == "auto":
        import torch

        if not torch.cuda.is_available():  # a GPU this torch cannot use: the parts run on the CPU
            return
    p = plan_for(cfg, gpu)
    console.print(f"GPU memory ({gpu / GB:.0f} GB): {p.summary()}; {p.verdict()} (slime-async config memory)",
                  highlight=False)
    check_fits(p)


def _warm_start(cfg: Config, console: Console) -> tuple[Config, dict[str, Any] | None]:
    """The config with `model.path` set to the warm-started model (trained now or cached)."""
    if not cfg.warmstart.enabled:
        return cfg, None
    from slime_async.models.tiny_model import default_cache_dir
    from slime_async.train.warmstart import warm_start

    base = resolve_model_path(cfg.model.path)
    began = time.monotonic()
    with Progress(TextColumn("warm-start"), BarColumn(), MofNCompleteColumn(), TextColumn("nll {task.fields[nll]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task("warm-start", total=None, nll="-")

        def report(step: int, steps: int, loss: float) -> None:
            progress.update(bar, completed=step, total=steps, nll=f"{loss:.3f}")
            # a bar draws nothing into a log file: there, a line every tenth of the way
            if not console.is_terminal and (step == steps or step % max(1, steps // 10) == 0):
                console.print(f"warm-start step {step}/{steps}, nll {loss:.3f}, {time.monotonic() - began:.0f} s")

        path, cached = warm_start(cfg, base, default_cache_dir(), report)
    give_back_device_memory()
    info = json.loads((path / "warmstart.json").read_text())
    console.print(f"warm-start: {'cached' if cached else 'trained'} {path} ({info['demonstrations']} demonstrations, "
                  f"{info['steps']} steps, final nll {info['final_nll']:.3f}, {time.monotonic() - began:.0f} s)")
    model = msgspec.structs.replace(cfg.model, path=str(path))
    return msgspec.structs.replace(cfg, model=model), {**info, "path": str(path), "cached": cached}


def give_back_device_memory() -> None:
    """Return to the device what PyTorch's allocator keeps cached in this process. The warm-start trains
    here, on the run's device; the cache it leaves (a 1.5B model's weights, gradients and Adam state:
    35.6 GB seen on an H100) would otherwise stay held beside the engines and the trainer for the whole
    run, and the trainer ran out of memory beside it. CUDA's own context (under 1 GB) stays."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def buffer_counts(launcher: LocalLauncher) -> dict[str, int] | None:
    """received = trained + buffered + dropped, as the buffer counts them at the end of the run."""
    from slime_async.buffer import BufferClient

    curve_dir = getattr(launcher, "client_curve_dir", None) or launcher.cfg.buffer.curve_dir
    client = BufferClient(launcher.buffer_endpoint, curve_dir=curve_dir)
    try:
        return client.metrics(timeout=10)
    except TimeoutError:
        return None
    finally:
        client.close()


def buffer_books(b: dict[str, int]) -> str:
    """`received = trained + buffered + dropped (by reason)`, checked: a mismatch is said, not hidden."""
    reasons = {k.removeprefix("dropped_"): v for k, v in b.items() if k.startswith("dropped_") and k != "dropped_total"}
    dropped = b.get("dropped_total", sum(reasons.values()))
    by_reason = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()) if n)
    text = (f"received {b.get('received', 0)} = trained {b.get('trained', 0)} + buffered {b.get('buffered', 0)} + "
            f"dropped {dropped}" + (f" ({by_reason})" if by_reason else ""))
    if b.get("received", 0) != b.get("trained", 0) + b.get("buffered", 0) + dropped:
        text += " [red]DOES NOT ADD UP[/]"
    return text


def episode_books(workers: list[dict[str, Any]], b: dict[str, int]) -> str:
    """Every episode the run started, across restarts: `started = received by the buffer + dropped by
    the rollout (by reason) + lost in flight when a worker died + in flight (+ sent but not acked when
    a worker died)`. Checked exactly when no worker died; a killed worker's counts are those of its last
    report (every 2 s), so after a death the line says so instead."""
    totals = [w["totals"] for w in workers]
    started = sum(t["started"] for t in totals)
    dropped: dict[str, int] = {}
    for t in totals:
        for reason, n in t["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    lost = sum(t["lost_in_flight"] for t in totals)
    in_flight = sum(w["in_flight"] for w in workers)
    unacked = sum(t["sent"] for t in totals) - b.get("received", 0)
    by_reason = ", ".join(f"{n} {r}" for r, n in sorted(dropped.items()) if n)
    text = (f"started {started} = to the buffer {b.get('received', 0)} + dropped by the rollout "
            f"{sum(dropped.values())}" + (f" ({by_reason})" if by_reason else "") +
            f" + lost in flight with a dead worker {lost} + in flight {in_flight}")
    if lost > 0 or any(t["lives"] > 1 for t in totals):  # restarted, or the run resumed
        return text + f" (a killed worker's counts are from its last report: {unacked:+d} between sent and received)"
    if unacked or started != b.get("received", 0) + sum(dropped.values()) + in_flight:
        text += " [red]DOES NOT ADD UP[/]"
    return text


def rollout_stats(run_dir: Path) -> list[dict[str, Any]]:
    """What each rollout worker last reported (`rollout-<i>.json`)."""
    out = []
    for path in sorted(run_dir.glob("rollout-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # replaced while read
    return out


def guard_verdicts(workers: list[dict[str, Any]]) -> list[dict[str, str]]:
    """What the workers' guards found, one verdict per rule (the first worker's to find it)."""
    out: dict[str, dict[str, str]] = {}
    for w in workers:
        for v in w.get("guard", []):
            out.setdefault(v["rule"], v)
    return list(out.values())


def stop_verdict(verdicts: list[dict[str, str]]) -> dict[str, str] | None:
    return next((v for v in verdicts if v["action"] == "stop"), None)


def _error_rows(table: Table, errors: dict[str, Any], verdicts: list[dict[str, str]]) -> None:
    """Failures by name (first message each) and the guard's findings, in red and yellow."""
    for i, line in enumerate(describe_errors(errors)):
        table.add_row("[red]errors[/]" if i == 0 else "", f"[red]{escape(line)}[/]")
    for v in verdicts:
        label = "[red]stopped[/]" if v["action"] == "stop" else "[yellow]warning[/]"
        first = f"; first error: {v['first_error']}" if v["first_error"] else ""
        table.add_row(label, escape(v["reason"] + first))


def _view(cfg: Config, run_dir: Path, started: float) -> Table:
    records = read_jsonl(run_dir / "metrics.jsonl")
    table = Table(title=f"slime-async train: {cfg.run.name}", show_header=False)
    last = records[-1] if records else {}
    table.add_row("step", f"{last.get('version', 0)} / {cfg.train.steps}")
    table.add_row("elapsed", f"{time.monotonic() - started:.0f} s")
    for key in ("loss", "grad_norm", "reward_mean", "max_staleness", "trajectories"):
        if key in last:
            value = last[key]
            table.add_row(f"train {key}", f"{value:.4g}" if isinstance(value, float) else str(value))
    workers = rollout_stats(run_dir)
    if workers:
        recent = [w["recent_reward"] for w in workers if w.get("recent_reward") is not None]
        dropped = sum(sum(w["groups_dropped"].values()) for w in workers)
        table.add_row("rollout", f"{sum(w['episodes_per_s'] for w in workers):.1f} episodes/s, "
                                 f"{sum(w['tokens_per_s'] for w in workers):.0f} tokens/s, "
                                 f"{sum(w['in_flight'] for w in workers)} in flight")
        table.add_row("rollout reward", f"{sum(recent) / len(recent):.3f} (last 256 episodes)" if recent else "-")
        table.add_row("groups", f"{sum(w['groups_sent'] for w in workers)} sent, {dropped} dropped (filtered/failed)")
        if teacher := distill_line(workers):
            table.add_row("distill teacher", teacher)
        _error_rows(table, merge_errors([w.get("errors", {}) for w in workers]), guard_verdicts(workers))
    now = time.time()
    hint = stall_hint(last.get("time"), now - (time.monotonic() - started), now, workers)
    if hint:
        table.add_row("[yellow]stalled[/]", f"[yellow]{hint}[/]")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if evals:
        scores = ", ".join(f"{k.split('/')[1]} {v:.1%}" for k, v in evals[-1].items() if k.endswith("/pass@1"))
        table.add_row("held-out eval", f"{scores} at version {evals[-1]['version']}")
    return table


def distill_line(workers: list[dict[str, Any]]) -> str | None:
    """What the teacher of `train.distill` did across the workers, or None when not distilling: the
    trajectories it scored and those it could not (down or slow: trained without the KL term)."""
    books = [w["distill"] for w in workers if "distill" in w]
    if not books:
        return None
    scored = sum(b.get("scored", 0) for b in books)
    missed = sum(b.get("teacher_unavailable", 0) for b in books)
    retries = sum(b.get("retries", 0) for b in books)
    line = (f"{scored} trajectories scored, {missed} teacher_unavailable (trained without the KL term), "
            f"{retries} retries")
    return f"[yellow]{line}[/]" if missed else line


def stall_hint(last_step_at: float | None, started_at: float, now: float, workers: list[dict[str, Any]],
               after_s: float = 60.0) -> str | None:
    """Why the trainer has made no step for `after_s` seconds or more (wall-clock times), or None.

    The usual cause is not a bug but the policy: when no episode (or every episode) of a group
    succeeds, the group carries no GRPO signal and `rollout.filter_equal_rewards` drops it, so a
    collapsed policy starves the trainer while the rollout looks busy."""
    since = now - (last_step_at if last_step_at is not None else started_at)
    if since < after_s:
        return None
    head = f"no trainer step for {since:.0f} s"
    recent = [w["recent_reward"] for w in workers if w.get("recent_reward") is not None]
    equal = sum(w.get("groups_dropped", {}).get("equal_rewards", 0) for w in workers)
    if recent and equal:
        reward = sum(recent) / len(recent)
        if reward <= 0.01 or reward >= 0.99:
            what = "no episode succeeds" if reward <= 0.01 else "every episode succeeds"
            return (f"{head}: {what} (mean reward {reward:.3f} of the latest episodes), so every group has "
                    f"equal rewards and is dropped ({equal} so far, rollout.filter_equal_rewards). A collapsed "
                    "policy (try a lower train.lr) or a task too hard or too easy for the model")
    return f"{head}: waiting for whole groups from the rollout workers (their logs: logs/rollout-*.log)"


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table: success before/after, steps, samples, throughput, staleness, time."""
    table = Table(title="run summary", show_header=False)
    for key, label in (("success_before", "success before RL"), ("success_after", "success after RL")):
        if s := summary.get(key):
            rewards = ""
            if "mean_reward" in s.get("sampled_metrics", {}):  # a reward that is not 0/1 says more than success
                rewards = (f"; mean reward {s['sampled_metrics']['mean_reward']:.3f} sampled, "
                           f"{s['greedy_metrics']['mean_reward']:.3f} greedy")
            success = f"{s['sampled']:.1%} sampled, {s['greedy']:.1%} greedy ({s['tasks']} held-out)"
            table.add_row(label, success + rewards)
    last = summary.get("last") or {}
    counters = last.get("counters", {})
    trained = counters.get("trajectories_trained", 0)
    rl_s = summary.get("rl_s") or 0.0
    table.add_row("trainer steps", f"{summary['steps']} (version {last.get('version', 0)})")
    table.add_row("samples trained", f"{trained} ({trained / rl_s:.1f}/s)" if rl_s else str(trained))
    if summary.get("max_staleness") is not None:
        table.add_row("max staleness", str(summary["max_staleness"]))
    if b := summary.get("buffer"):
        table.add_row("buffer", buffer_books(b))
        if summary.get("rollout"):
            table.add_row("episodes", episode_books(summary["rollout"], b))
    if workers := summary.get("rollout"):
        dropped: dict[str, int] = {}
        for w in workers:
            for reason, n in w["groups_dropped"].items():
                dropped[reason] = dropped.get(reason, 0) + n
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(dropped.items())) or "none"
        table.add_row("rollout", f"{sum(w['episodes'] for w in workers)} episodes, "
                                 f"{sum(w['groups_sent'] for w in workers)} groups sent, dropped: {reasons}")
        if teacher := distill_line(workers):
            table.add_row("distill teacher", teacher)
    _error_rows(table, summary.get("errors") or {}, summary.get("guard") or [])
    if w := summary.get("warmstart"):
        took = "cached" if w["cached"] else f"{w['seconds']:.0f} s"
        table.add_row("warm-start", f"{took}, {w['steps']} steps on {w['demonstrations']} demonstrations")
    table.add_row("RL time", f"{rl_s:.0f} s")
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    return table
