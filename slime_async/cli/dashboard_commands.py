"""`slime-async dashboard` and `slime-async replay` (registered on `cli.app.app` when `cli.main` imports this)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from slime_async.cli.app import app, clear_errors, console, fail

DEFAULT_PORT = 8780


@app.command()
@clear_errors
def dashboard(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (runs/NAME); two or more are compared.",
                                               show_default=False)],
    host: Annotated[str, typer.Option(help="Where to listen; off loopback a token is required (printed).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one).")] = DEFAULT_PORT,
) -> None:
    """Serve the web dashboard and trajectory viewer of one or more runs, live or finished (Ctrl-C stops it)."""
    from slime_async.dashboard.serve import serve, token_for, url_with_token
    from slime_async.dashboard.server import DashboardError
    from slime_async.rundir.run_files import RunDirError

    token = token_for(host)
    try:
        asyncio.run(serve(runs, host, port, token, lambda url: console.print(
            f"dashboard of {', '.join(str(r) for r in runs)}: {url_with_token(url, token)} (Ctrl-C stops it)",
            soft_wrap=True, highlight=False)))
    except (RunDirError, DashboardError) as exc:
        fail(str(exc))


@app.command()
@clear_errors
def replay(
    file: Annotated[Path, typer.Argument(help="A trajectory exported by the dashboard (its 'export' link).",
                                         show_default=False)],
    config: Annotated[Path | None, typer.Option(help="Replay under this config instead of the one recorded "
                                                     "in the file (an env changed since).")] = None,
) -> None:
    """Run a recorded episode again through its env with the recorded model replies (no engine), and
    say where the env now answers differently."""
    from slime_async.dashboard.replay import ReplayError, replay_file

    try:
        report = asyncio.run(replay_file(file, config))
    except ReplayError as exc:
        fail(str(exc))
    console.print(report.render(), highlight=False, soft_wrap=True)
    if not report.same:
        raise typer.Exit(1)
