"""The `slime-async` typer app, its consoles, and the one-line error exit every command shares.

Its own module so that command modules (`main`, `dashboard_commands`) register on `app` without
importing each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console

from slime_async.config import ConfigError

app = typer.Typer(
    name="slime-async",
    help="Asynchronous agentic RL post-training: SGLang rollouts, ZeroMQ buffer, torch/Megatron trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str) -> NoReturn:
    """Print one error line naming the place and the fix, exit with code 2."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def clear_errors(fn: F) -> F:
    """Turn the errors that mean bad input into one line and exit code 2, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, FileExistsError) as exc:
            fail(str(exc))

    return wrapper  # type: ignore[return-value]
