"""The OpenAI-compatible endpoint (aiohttp): one per rollout process, one session per episode.

Each episode of an agent env opens a session and hands its agent a base URL of its own,
`http://127.0.0.1:PORT/s/<session>/v1`, and an API key of its own; one agent program can so run
many episodes at once, each call landing in its episode. Routes:

- `POST /s/<session>/v1/chat/completions`: the session's model call (`DrivenEpisode.complete`),
  through the rollout worker's own SGLang client (same servers, sticky routing, retries, abort and
  resume across weight updates: a call during an update waits, it does not fail);
- `GET /s/<session>/v1/models` and `GET /v1/models`: the one model served.

Errors have OpenAI's shape and a 4xx status (an SDK retries 5xx and 409, which would only repeat
them): 400 for a request that cannot be honoured (it names the field) or an episode that is over,
401 for a wrong key, 404 for an unknown or released session, 413 for a body over `max_body_bytes`.
Binds to loopback: the agents run in the same process or on the same machine.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import weakref
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from slime_async.agents import openai_api as api
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
        """Chat completions answered (errors included)."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
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

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return _error(404, "unknown session (never opened, or its episode has ended)", code="unknown_session")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode("utf-8", "replace"), session.key.encode()):
            return _error(401, "wrong API key for this session", kind="authentication_error", code="invalid_api_key")
        try:
            req = api.decode_request(await request.read())
            problems = api.unsupported(req)
            if problems:
                raise BadCall("cannot be honoured: " + "; ".join(problems))
            messages = api.to_messages(req)
            episode = session.episode
            tools = api.tool_schemas(req)
            completions = await episode.complete(
                messages, tools=tools, sampling=api.to_sampling(req, episode.sampling), n=req.n or 1,
                parse_tools=bool(tools) and req.tool_choice != "none", render_tools=session.render_tools,
            )  # fmt: skip
        except BadCall as exc:
            return _error(400, str(exc))
        except EpisodeOver as exc:
            return _error(400, str(exc), code="episode_over")
        model = req.model or self.model
        if not req.stream:
            return _json(api.completion_object(completions, model, bool(req.logprobs), episode.tokenizer))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in api.chunks(completions, model, include_usage):
            await resp.write(b"data: " + _JSON.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_JSON.encode(obj), status=status, content_type="application/json")


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return _json(api.error_object(message, kind, code), status)


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


async def close_shared_server() -> None:
    """Stop this loop's server, if one was started (a worker's last step)."""
    started = _SHARED.pop(asyncio.get_running_loop(), None)
    if started is not None and started.done() and not started.exception():
        await started.result().close()
