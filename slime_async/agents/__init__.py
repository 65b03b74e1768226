"""Agents: black-box agent programs, written against the OpenAI or Anthropic APIs, trained unchanged.

Owns:
- the endpoint (`server.AgentServer`, aiohttp): `POST /s/<session>/v1/chat/completions`,
  `/v1/messages` and `/v1/responses`, `GET /v1/models`, one session per episode, started on first
  use in each rollout process;
- the wire formats, each an `Api` (`protocol`): Chat Completions (`openai_api`), Anthropic Messages
  (`anthropic_api`), OpenAI Responses (`responses_api`): request, reply and SSE shapes, with a 400
  that names every field it cannot honour;
- `AgentEnv`: an env whose episodes run an agent function `run(task, base_url, api_key)`;
- `CommandAgentEnv` (`command`): one whose episodes run an agent program of its own (its own
  virtualenv), which reaches the endpoint only over HTTP.

Does not own: the token bookkeeping of a session (`slime_async.env.driven`: the same renderer,
limits and rewards as every env), the inference servers or their client (`rollout`).
"""

from slime_async.agents.command import CommandAgentEnv, CommandArgs
from slime_async.agents.env import AgentArgs, AgentEnv, load_agent
from slime_async.agents.server import AgentServer, close_shared_server, opened_session, shared_server

__all__ = ["AgentArgs", "AgentEnv", "AgentServer", "CommandAgentEnv", "CommandArgs", "close_shared_server",
           "load_agent", "opened_session", "shared_server"]
