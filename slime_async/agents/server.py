"""The agent endpoint (aiohttp): one per rollout process, one session per episode, three APIs.

Each episode of an agent env opens a session and hands its agent a base URL of its own,
`http://127.0.0.1:PORT/s/<session>/v1`, and an API key of its own; one agent program can so run
many episodes at once, each call landing in its episode. Routes:

- `POST /s/<session>/v1/chat/completions` (OpenAI Chat Completions), `/v1/messages` (Anthropic
  Messages) and `/v1/responses` (OpenAI Responses): the session's model call (`DrivenEpisode.complete`,
  the same token bookkeeping whichever API an agent speaks, even several in one episode), through the
  rollout worker's own SGLang client (same servers, sticky routing, retries, abort and resume across
  weight updates: a call during an update waits, it does not fail);
- `GET /s/<session>/v1/models` and `GET /v1/models`: the one model served.

The key comes as `Authorization: Bearer` (OpenAI's clients) or `x-api-key` (Anthropic's). Errors
have the API's own shape and a 4xx status (an SDK retries 5xx and 409, which would only repeat
them): 400 for a request that cannot be honoured (it names the field) or an episode that is over,
401 for a wrong key, 404 for an unknown or released session, 413 for a body over `max_body_bytes`.
Binds to loopback: the agents run in the same process or on the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from slime_async.agents.anthropic_api import MessagesApi
from slime_async.agents.openai_api import ChatApi
from slime_async.agents.protocol import Api
from slime_async.agents.responses_api import ResponsesApi
from slime_async.env.driven import BadCall, DrivenEpisode, EpisodeOver
from slime_async.types import new_id

_JSON = msgspec.json.Encoder()


@dataclass
class _Session:
    episode: DrivenEpisode
    key: str
    render_tools: bool


class AgentServer:
    """Sessions by id, served over HTTP. `open` one per episode, `release` it when the episode ends."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, model: str = "policy",
                 max_body_bytes: int = 16 << 20) -> None:
        self.host, self.port, self.model = host, port, model
        self.max_body_bytes = max_body_bytes
        self.sessions: dict[str, _Session] = {}
        self.calls = 0
        """Model calls answered, in any API (errors included)."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        for path, api in (("chat/completions", ChatApi()), ("messages", MessagesApi()), ("responses", ResponsesApi())):
            app.router.add_post("/s/{sid}/v1/" + path, functools.partial(self._serve, api=api))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: DrivenEpisode, render_tools: bool = True) -> tuple[str, str, str]:
        """A new session for `episode`: (session id, base URL, API key)."""
        sid, key = new_id(), "sk-" + new_id()
        self.sessions[sid] = _Session(episode, key, render_tools)
        return sid, f"{self.url}/s/{sid}/v1", key

    def release(self, sid: str) -> None:
        """Forget a session: its later calls get 404."""
        self.sessions.pop(sid, None)

    # ---- routes ------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "slime-async"}
        return _json({"object": "list", "data": [entry]})

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        """One model call in `api`'s format: the session, its key, the call, the reply or its error."""
        self.calls += 1
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return _error(api, 404, "unknown session (never opened, or its episode has ended)", "unknown_session")
        # `Authorization: Bearer` (OpenAI's clients) or `x-api-key` (Anthropic's)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip() or request.headers.get(
            "x-api-key", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), session.key.encode()):
            return _error(api, 401, "wrong API key for this session", "invalid_api_key")
        episode = session.episode
        try:
            call = api.call(await request.read(), episode.sampling)
            completions = await episode.complete(call.messages, tools=call.tools, sampling=call.sampling, n=call.n,
                                                 parse_tools=call.parse_tools, render_tools=session.render_tools)
        except BadCall as exc:
            return _error(api, 400, str(exc))
        except EpisodeOver as exc:
            return _error(api, 400, str(exc), "episode_over")
        call.model = call.model or self.model
        if not call.stream:
            return _json(api.reply(call, completions, episode.tokenizer))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for event in api.events(call, completions):
            await resp.write(event)
        await resp.write_eof()
        return resp


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_JSON.encode(obj), status=status, content_type="application/json")


def _error(api: Api, status: int, message: str, code: str | None = None) -> web.Response:
    return _json(api.error(status, message, code), status)


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future[AgentServer]] = (
    weakref.WeakKeyDictionary())
"""One server per event loop (a rollout worker has one loop), started by its first episode."""


async def shared_server() -> AgentServer:
    """This loop's server, started on first use (concurrent first uses share one start)."""
    loop = asyncio.get_running_loop()
    started = _SHARED.get(loop)
    if started is None:
        started = _SHARED[loop] = loop.create_future()
        server = AgentServer()
        try:
            await server.start()
        except BaseException as exc:
            del _SHARED[loop]
            started.set_exception(exc)
            raise
        started.set_result(server)
    return await asyncio.shield(started)


@contextlib.asynccontextmanager
async def opened_session(episode: DrivenEpisode, render_tools: bool = True) -> AsyncIterator[tuple[str, str]]:
    """A session of this loop's server for `episode`, as (base URL, API key), released on exit."""
    server = await shared_server()
    sid, base_url, api_key = server.open(episode, render_tools=render_tools)
    try:
        yield base_url, api_key
    finally:
        server.release(sid)


async def close_shared_server() -> None:
    """Stop this loop's server, if one was started (a worker's last step)."""
    started = _SHARED.pop(asyncio.get_running_loop(), None)
    if started is not None and started.done() and not started.exception():
        await started.result().close()
