"""`CommandAgentEnv`: an agent that is a program of its own (its own virtualenv, its own pins, any
language), run once per episode, reaching the endpoint only over HTTP.

    env:
      name: envs.openai_agent:CommandAgentEnv
      args: {command: [/path/to/agent-venv/bin/python, my_agent.py]}

Each episode runs `command` with its session in the environment variables that the SDKs read by
themselves: `OPENAI_BASE_URL` / `OPENAI_API_KEY` (the `openai` SDK, LangChain, smolagents'
`OpenAIServerModel` given them) and `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` (the `anthropic` SDK,
harnesses built on it), plus `SLIME_TASK`: the task as JSON (`id`, `prompt`, `answer`, `metadata`), also
written to its stdin. The last line it prints is its reward (a number; nothing or `null` leaves the
reward to the env's `@reward`s). A non-zero exit ends the episode with `env_error` and the end of its
stderr; an episode that ends first (a limit, the caller's stop) kills the program's process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from typing import Any

import msgspec

from slime_async.agents.server import opened_session
from slime_async.env import Env, EnvArgs
from slime_async.env.driven import DrivenEpisode

_TAIL = 2000
"""Characters of a failed program's stderr kept in the episode's error."""


class CommandArgs(EnvArgs):
    command: list[str] = msgspec.field(default_factory=list)
    """The agent program's argv, run once per episode (e.g. `[/path/to/venv/bin/python, agent.py]`). Required."""
    cwd: str | None = None
    """Its working directory (None: the rollout worker's)."""
    render_tools: bool = True
    """As `AgentArgs.render_tools`."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command: required: the agent program's argv, e.g. [/path/to/venv/bin/python, agent.py]")


class CommandAgentEnv(Env):
    """Runs `args.command` once per episode against its own session; see the module's docstring."""

    Args = CommandArgs
    args: CommandArgs

    async def drive(self, session: DrivenEpisode) -> float | None:
        async with opened_session(session, self.args.render_tools) as (base_url, api_key):
            return await run_command(self.args.command, self.task, base_url, api_key, self.args.cwd)


async def run_command(command: list[str], task: Any, base_url: str, api_key: str,
                      cwd: str | None = None) -> float | None:
    """Run the agent program for one episode (see the module's docstring); its reward."""
    task_json = msgspec.json.encode(task)
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
           "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key,
           "SLIME_TASK": task_json.decode()}
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, cwd=cwd, start_new_session=True)  # its own group: killed whole, children included
    try:
        out, err = await proc.communicate(task_json)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with {proc.returncode}: {err.decode(errors='replace')[-_TAIL:]}")
    lines = out.decode(errors="replace").strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if last in ("", "null", "None"):
        return None
    try:
        return float(json.loads(last))
    except (ValueError, TypeError):
        raise RuntimeError(f"{command[0]} printed {last!r} last; expected its reward (a number, or null)") from None
