"""Agents: black-box agent programs, written against the OpenAI API, trained unchanged.

Owns:
- the OpenAI-compatible endpoint (`server.AgentServer`, aiohttp): `POST /s/<session>/v1/chat/completions`
  and `GET /v1/models`, one session per episode, started on first use in each rollout process;
- the Chat Completions request, reply and SSE shapes (`openai_api`), with a 400 that names every
  field it cannot honour;
- `AgentEnv`: an env whose episodes run an agent function `run(task, base_url, api_key)`.

Does not own: the token bookkeeping of a session (`slime_async.env.driven`: the same renderer,
limits and rewards as every env), the inference servers or their client (`rollout`).
"""

from slime_async.agents.env import AgentArgs, AgentEnv, load_agent
from slime_async.agents.server import AgentServer, close_shared_server, shared_server

__all__ = ["AgentArgs", "AgentEnv", "AgentServer", "close_shared_server", "load_agent", "shared_server"]
