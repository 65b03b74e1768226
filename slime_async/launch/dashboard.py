"""The dashboard of a `slime-async train` run: its own process beside the run's parts, URL printed.

It is a view, not a part: it is not restarted, and a dashboard that cannot start (the configured
port is taken) is said in one line and the run goes on without it. It stops with the run; the same
page opens again from the directory alone (`slime-async dashboard runs/NAME`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from slime_async.dashboard.serve import TOKEN_ENV, token_for, url_with_token
from slime_async.launch.process import ChildProcess, start_process


def start_dashboard(cfg: Any, run_dir: Path, console: Console) -> ChildProcess | None:
    """Start the dashboard of `run_dir` when `log.dashboard` is on; None when off or it failed."""
    log = cfg.log
    if not log.dashboard:
        return None
    token = token_for(log.dashboard_host)
    argv = [sys.executable, "-m", "slime_async.dashboard", str(run_dir), "--host", log.dashboard_host,
            "--port", str(log.dashboard_port)]
    try:
        # the token reaches it in the environment: a command line is readable by every user
        child = start_process("dashboard", argv, r"^DASHBOARD (\S+)", timeout=60,
                              log_path=run_dir / "logs" / "dashboard.log", env={TOKEN_ENV: token} if token else None)
    except RuntimeError as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else str(exc)
        console.print(f"[yellow]dashboard not started ({last}); the run goes on without it "
                      f"(log.dashboard_port, or log.dashboard=false)[/]", highlight=False, soft_wrap=True)
        return None
    console.print(f"dashboard: [bold]{url_with_token(child.ready, token)}[/]", highlight=False, soft_wrap=True)
    return child


def stop_dashboard(child: ChildProcess | None, run_dir: Path, console: Console) -> None:
    if child is None:
        return
    child.stop(timeout=10)
    shown = os.path.relpath(run_dir) if run_dir.resolve().is_relative_to(Path.cwd()) else str(run_dir)
    console.print(f"dashboard stopped; `slime-async dashboard {shown}` opens it again", highlight=False,
                  soft_wrap=True)
