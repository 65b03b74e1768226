"""An agent that is a program of its own (`CommandAgentEnv`): run in a fresh, empty virtualenv (its own
interpreter, no slime_async, no SDK installed), reaching the endpoint only over HTTP."""

from __future__ import annotations

import os
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
from test_apis import REPLIES
from transformers import AutoTokenizer

from slime_async.agents import CommandAgentEnv, close_shared_server
from slime_async.env import EnvFactory, EnvLoadError, Limits, ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task, Trajectory

AGENT = Path(__file__).with_name("stdlib_agent.py")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def own_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv's interpreter (under a second: no pip, nothing installed)."""
    where = tmp_path_factory.mktemp("agent_venv")
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    assert os.path.realpath(sys.prefix) != os.path.realpath(where)
    return python


async def play(tokenizer: Any, python: Path, task: Task, replies: list[str], **limits: Any) -> Trajectory:
    args = CommandAgentEnv.Args(command=[str(python), str(AGENT)], **({"limits": Limits(**limits)} if limits else {}))
    try:
        return await run_episode(CommandAgentEnv(args), task, ScriptedPolicy(replies, tokenizer), tokenizer)
    finally:
        await close_shared_server()


async def test_an_agent_in_its_own_virtualenv_trains_over_http(tokenizer: Any, own_python: Path) -> None:
    task = Task(id="v", prompt="What is 12*34+5?", answer=413, metadata={})
    traj = await play(tokenizer, own_python, task, REPLIES)
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
    assert traj.metrics["tool_calls"] == 1 and len(traj.turns) == 2
    assert "<tool_response>413</tool_response>" in tokenizer.decode(traj.turns[1].prompt_ids.tolist())
    no_sdk = await play(tokenizer, own_python, Task(id="w", prompt="x", answer=1, metadata={"fail": True}), [])
    assert no_sdk.stop_reason is StopReason.ENV_ERROR and "exited with 1: the agent fell over" in no_sdk.error


async def test_a_program_that_outlives_its_episode_is_killed(tokenizer: Any, own_python: Path) -> None:
    task = Task(id="h", prompt="x", answer=1, metadata={"hang": True})
    traj = await play(tokenizer, own_python, task, [], episode_timeout_s=1.0)
    assert traj.stop_reason is StopReason.EPISODE_TIMEOUT
    running = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(AGENT) in _cmdline(p)]
    assert running == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_command_is_required() -> None:
    with pytest.raises(EnvLoadError, match=r"command: required"):
        EnvFactory.from_config("envs.openai_agent:CommandAgentEnv", {})
