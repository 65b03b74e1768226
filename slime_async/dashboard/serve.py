"""Serving the dashboard until stopped: `slime-async dashboard RUN_DIR ...`, and the process that
`slime-async train` starts (`python -m slime_async.dashboard RUN_DIR --port P`, which prints
`DASHBOARD URL` when it listens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from slime_async.config.schema import is_loopback_host
from slime_async.dashboard.run_view import open_runs
from slime_async.dashboard.server import Dashboard, DashboardError, start
from slime_async.rundir.run_files import RunDirError

TOKEN_ENV = "SLIME_ASYNC_DASHBOARD_TOKEN"


def token_for(host: str) -> str | None:
    """None on loopback; elsewhere `$SLIME_ASYNC_DASHBOARD_TOKEN` or a fresh random one."""
    if is_loopback_host(host):
        return None
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)


def url_with_token(url: str, token: str | None) -> str:
    return f"{url}?token={token}" if token else url


async def serve(paths: list[Path], host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT/SIGTERM. Raises RunDirError or DashboardError before listening."""
    dashboard = Dashboard(open_runs(paths), token=token)
    runner, url = await start(dashboard, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    on_ready(url)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime_async.dashboard")
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    token = token_for(args.host)
    try:
        # the URL without its token: this line goes to a log file; whoever started us has the token
        asyncio.run(serve(args.runs, args.host, args.port, token, lambda url: print(f"DASHBOARD {url}", flush=True)))
    except (RunDirError, DashboardError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
