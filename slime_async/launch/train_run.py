"""`slime-async train`: a run directory, every part as a process (here, or under Ray actors with
`--ray`), a live view, a summary at the end.

The run directory `<run.dir>/<run.name>` holds the resolved config (`config.yaml`, what every part
reads), `logs/` (one file per part), `metrics.jsonl` (one line per trainer step, written by the
trainer), the buffer's WAL and the checkpoints. `--resume` continues a run from them; without it,
an existing run directory is refused rather than overwritten.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from slime_async.config import Config, ConfigError, to_yaml
from slime_async.launch.local import LocalLauncher


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def train(cfg: Config, resume: bool = False, overwrite: bool = False, console: Console | None = None,
          ray: str | None = None) -> dict:
    """Run the whole asynchronous loop until the trainer has done `train.steps` steps: locally, or on
    a Ray cluster when `ray` is given (an address, or "" for `launch.ray.address` / Ray's discovery)."""
    console = console or Console()
    run_dir, config_path = prepare_run_dir(cfg, resume, overwrite)
    launcher: LocalLauncher
    if ray is not None:
        from slime_async.launch.ray_launcher import RayLauncher

        launcher = RayLauncher(cfg, config_path, run_dir, address=ray or None)
    else:
        launcher = LocalLauncher(cfg, config_path, run_dir)
    started = time.monotonic()
    where = "as Ray actors" if ray is not None else "as processes"
    with console.status(f"starting buffer, engines, trainer and rollout workers {where} ..."):
        launcher.start(on_event=lambda message: console.print(f"[yellow]{message}[/]"))
    parts = launcher.describe()
    metrics_path = run_dir / "metrics.jsonl"
    try:
        with Live(_view(cfg, [], started), console=console, refresh_per_second=1) as live:
            def done() -> bool:
                live.update(_view(cfg, read_metrics(metrics_path), started))
                return False

            launcher.supervise(done)
        launcher.stop_rollout()  # what the workers finished reaches the buffer before it is counted
        buffer_metrics = buffer_counts(launcher)
    finally:
        launcher.shutdown()
    records = read_metrics(metrics_path)
    evals = read_metrics(run_dir / "eval.jsonl")
    summary = {"steps": len(records), "wall_s": time.monotonic() - started, "events": launcher.events, "parts": parts,
               "last": records[-1] if records else None, "buffer": buffer_metrics, "eval": evals,
               "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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


def _view(cfg: Config, records: list[dict[str, Any]], started: float) -> Table:
    table = Table(title=f"slime-async train: {cfg.run.name}", show_header=False)
    last = records[-1] if records else {}
    table.add_row("step", f"{last.get('version', 0)} / {cfg.train.steps}")
    table.add_row("elapsed", f"{time.monotonic() - started:.0f} s")
    for key in ("loss", "grad_norm", "reward_mean", "max_staleness", "trajectories"):
        if key in last:
            value = last[key]
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table
