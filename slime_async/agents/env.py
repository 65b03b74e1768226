"""`AgentEnv`: an environment whose episodes are an agent program written against the OpenAI API.

The agent is an ordinary function, named in the config (`env.args.agent: module:function`):

    async def run(task: Task, base_url: str, api_key: str) -> float | None

It gets the task, and a base URL and key of its own episode's session on this process's endpoint
(`slime_async.agents.server`: chat completions, Anthropic messages, OpenAI responses); it makes its
model calls there with any client (the `openai` SDK, the OpenAI Agents SDK, the `anthropic` SDK with
`base_url.removesuffix("/v1")`, LangGraph, smolagents, raw HTTP), runs its own
tools, and returns its reward, or None to leave the reward to the env's `@reward`s (a subclass
may declare them; they see the final reply as `completion` and the conversation as `messages`).
A plain `def` runs in a thread. Each episode's calls are recorded token-exactly
(`slime_async.env.driven`) and train like any env's: GRPO groups, staleness admission, partial
rollouts across weight updates, limits with their stop reasons.

Tasks: from a dataset (`data.source: jsonl`, rows `{"prompt": ..., "label": ...}`), or a subclass
overrides `tasks` (and `demonstration` for a warm-start), as `envs/calculator_agent.py` does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from slime_async.agents.server import opened_session
from slime_async.env import Env, EnvArgs, EnvLoadError
from slime_async.env.driven import DrivenEpisode
from slime_async.env.loading import import_named

Agent = Callable[[Any, str, str], Any]


class AgentArgs(EnvArgs):
    agent: str = ""
    """The agent, as `module:function`: `async def run(task, base_url, api_key) -> float | None`
    (a plain `def` runs in a thread). Required."""
    render_tools: bool = True
    """Put the tools that the agent sends into the prompt (the chat template's tool list), as the
    OpenAI API does. False for a model that learned its tools from demonstrations without their
    schemas (the tiny calculator model): the calls are still parsed and returned."""

    def __post_init__(self) -> None:
        if not self.agent:
            raise ValueError("agent: required: the agent function as 'module:function'")
        load_agent(self.agent)  # a wrong name is an error of the config, before any process starts


class AgentEnv(Env):
    """Runs `args.agent` once per episode against its own session; see the module's docstring."""

    Args = AgentArgs
    args: AgentArgs

    async def drive(self, session: DrivenEpisode) -> float | None:
        agent = load_agent(self.args.agent)
        async with opened_session(session, self.args.render_tools) as (base_url, api_key):
            if inspect.iscoroutinefunction(agent):
                return await agent(self.task, base_url, api_key)
            return await asyncio.to_thread(agent, self.task, base_url, api_key)


@functools.cache
def load_agent(name: str) -> Agent:
    """Import `module:function` and check that it takes (task, base_url, api_key)."""
    fn = import_named(name, "agent", "envs.calculator_agent:run", "function")
    if not callable(fn):
        raise EnvLoadError(f"agent: {name} is not a function")
    try:
        inspect.signature(fn).bind(None, "", "")
    except TypeError:
        raise EnvLoadError(f"agent: {name} must take (task, base_url, api_key)") from None
    return fn
