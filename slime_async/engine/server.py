"""The embedded engine's HTTP server: SGLang's endpoints, field names, response shapes and rules.

Responses follow SGLang 0.5.23's `http_server.py` and tokenizer manager (`replies`); the control
endpoints and their rules are in `control`; a request's prompts in `requests`. Errors are a 400 with
`{"error": {"message": ...}}` naming the field (on a stream, an error event, as SGLang sends it); the
server keeps serving. The differences from SGLang that are deliberate are listed in the README.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import urllib.parse
import uuid
from datetime import UTC, datetime
from typing import Any

import aiorwlock
import msgspec
from aiohttp import web

from slime_async.config.schema import is_loopback_host as is_loopback
from slime_async.engine import protocol as p
from slime_async.engine import requests
from slime_async.engine.control import ControlRoutes
from slime_async.engine.core import Engine, Sequence
from slime_async.engine.replies import dumps, error, held_back, json_response, reply

ADMIN_PATHS = {
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
    "/init_weights_update_group", "/update_weights_from_distributed", "/pause_generation",
    "/continue_generation", "/flush_cache", "/abort_request", "/release_memory_occupation",
    "/resume_memory_occupation",
}


SGLANG_API_VERSION = "0.5.23"
"""The SGLang release whose HTTP API the engine speaks (`/server_info`'s `version`)."""

MAX_STOP_COUNT = 32
"""SGLang's `MAX_STOP_COUNT`: stop strings per request."""

GENERATE_MAX_BYTES = 16 * 2**20
"""Largest `/generate` body: a context of token ids is a few hundred KB of JSON. Weight updates keep
the application's own (large) limit."""


HEALTH_CHECK_TIMEOUT = 20.0
"""SGLang's: `/health_generate` answers 503 when its one token has not come in this many seconds."""


class EngineServer(ControlRoutes):
    """aiohttp application over an `Engine`; one per model."""

    def __init__(self, engine: Engine, model_path: str, host: str = "127.0.0.1", admin_token: str | None = None):
        if not is_loopback(host) and not admin_token:
            raise ValueError(f"binding to {host} (not loopback) requires an admin token for the weight endpoints")
        self.engine = engine
        self.model_path = model_path
        self.host = host
        self.admin_token = admin_token
        self.app = web.Application(middlewares=[self._auth], client_max_size=2**31)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        self.add_control_routes(r)
        self._unpaused = asyncio.Event()
        """Cleared by /pause_generation: new requests wait for /continue_generation before anything."""
        self._unpaused.set()
        self._update_lock = aiorwlock.RWLock()
        """SGLang's model-update lock: each request holds it to read, an unpaused weight update to write."""
        self._held = 0
        """Requests waiting for /continue_generation before being looked at."""
        self._live: set[str] = set()
        """Ids of the requests being served (their prompts' and samples'): no two may share one."""
        self.started = time.time()
        self._weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values()) + 2**20
        """The most shared memory one update item may map: the model's own weights (and a little)."""
        self._shared_since = time.time()
        """Shared-memory files older than this were not made for the next update (`weight_wire.shared_tensors`)."""
        self._max_token_chars = max((len(t) for t in engine.tokenizer.get_vocab()), default=1) or 1
        """The longest token's length in characters (of its vocabulary string): bounds the text a context holds."""

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refused = _cross_site(request)
        if refused is not None:
            return error(403, refused)
        if request.path in ADMIN_PATHS and request.method == "POST" and request.can_read_body:
            # a browser sends text/plain, form or multipart bodies cross-site without asking first;
            # JSON it does not: a web page cannot drive these routes even with no token (loopback)
            kind = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return error(415, f"{request.path}: Content-Type must be application/json, got {kind or 'none'!r}")
        if self.admin_token and request.path in ADMIN_PATHS:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            # bytes: a str with non-ASCII characters makes compare_digest raise (a 500 before)
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.admin_token.encode()):
                return error(401, f"{request.path} needs the admin token (Authorization: Bearer ...)")
        return await handler(request)

    # --- info ---------------------------------------------------------------------------

    def _awaiting_weights(self) -> web.Response | None:
        """A replacement engine, started with the weight version `pending`, serves nothing until the
        trainer's weights arrive with a version: 503 on /health and /generate till then. Any other
        version is a name, as in SGLang."""
        if self.engine.weight_version != p.PENDING_VERSION:
            return None
        return error(503, f"weight version {self.engine.weight_version!r}: waiting for the trainer's weights")

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:  # it would never answer a /generate again
            return web.Response(status=503, text="the engine's loop has stopped")
        return self._awaiting_weights() or web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's: one token from a one-token prompt, as a request (held while paused, behind a weight
        update); 503 if it has not come within HEALTH_CHECK_TIMEOUT seconds."""
        seq = Sequence(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt=[0],
                       params=p.SamplingParams(max_new_tokens=1, temperature=0.0))

        async def one() -> None:
            await self._held_until_continued()
            async with self._update_lock.reader_lock:
                await self._run([seq])

        try:
            await asyncio.wait_for(one(), HEALTH_CHECK_TIMEOUT)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return json_response({
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            # a local path, so that sglang-router loads the tokenizer without a hub
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/server_info`: its server arguments that mean something here (those SGLang's own
        tools read among them: `tokenizer_path`, `page_size`, `disable_radix_cache`,
        `speculative_eagle_topk`, `internal_states`), with this engine's values."""
        e = self.engine
        state = {
            "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting), "num_held_reqs": self._held,
            "paused": e.paused,
            "decode_steps": e.steps, "generated_tokens": e.generated_tokens, "finished_reqs": e.finished,
            "aborted_reqs": e.aborted, "memory_released": sorted(e.released), "busy_s": e.busy_s,
            "startup_time": self.started, "effective_max_running_requests_per_dp": e.max_batch_size,
        }
        return json_response({
            "version": SGLANG_API_VERSION,
            "engine": "slime_async embedded",
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_path,
            "skip_tokenizer_init": False,
            "weight_version": e.weight_version,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
            "page_size": 1,
            "disable_radix_cache": True,  # no prefix cache outlives a request
            "speculative_algorithm": None,
            "speculative_eagle_topk": None,
            "device": e.slots.device.type,
            "random_seed": e.seed,
            "max_running_requests": e.max_batch_size,
            "context_length": e.context_length,
            "max_total_num_tokens": e.max_batch_size * e.context_length,
            "max_req_input_len": e.context_length - 1,
            "startup_time": self.started,
            "internal_states": [state],
        })

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's `GET /v1/loads` (its `/get_load` is deprecated, and gone in 0.5.23): per data-parallel
        rank (here one) the core of its `LoadSnapshot`: requests running, requests waiting for a batch
        slot, tokens held. What adaptive concurrency (`rollout.adaptive_concurrency`) sizes the episodes
        in flight from. Requests held by a pause are not counted: SGLang's scheduler does not see them."""
        e = self.engine
        running = list(e.running)
        used = sum(s.cached for s in running)
        capacity = e.max_batch_size * e.context_length
        return json_response({
            "timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_API_VERSION,
            "accelerator": None, "num_accelerators": 1,
            "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(running),
                       "num_waiting_reqs": len(e.waiting), "num_used_tokens": used, "num_total_tokens": used,
                       "max_total_num_tokens": capacity, "max_running_requests": e.max_batch_size,
                       "token_usage": used / capacity}],
        })

    # --- generation ---------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        waiting = self._awaiting_weights()
        if waiting is not None:
            return waiting
        if (request.content_length or 0) > GENERATE_MAX_BYTES:
            return error(413, f"/generate: a body of {request.content_length} bytes; at most {GENERATE_MAX_BYTES}")
        body = await _read_at_most(request, GENERATE_MAX_BYTES)  # chunked bodies too: never more
        if body is None:
            return error(413, f"/generate: a body over {GENERATE_MAX_BYTES} bytes")
        try:  # SGLang's contract check: a 400 even for a stream
            req = p.decode_body(body, p.GenerateReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._held_until_continued()
        async with self._update_lock.reader_lock:
            try:
                seqs, single = await self._admit(req)
            except ValueError as exc:
                if req.stream:
                    return await self._stream_error(request, str(exc))
                return error(400, str(exc))
            rids = {s.rid for s in seqs} | {s.request.rid for s in seqs}
            self._live |= rids
            try:
                if req.stream:
                    return await self._stream(request, req, seqs, single)
                done = await self._run(seqs)
                outs = [reply(req, s, self.engine.tokenizer, self.engine.weight_version, True) for s in done]
                return json_response(outs[0] if single else outs)
            finally:
                self._live -= rids

    async def _held_until_continued(self) -> None:
        """SGLang holds a request that arrives while paused before anything else, until continued
        (counted in `/server_info` as `num_held_reqs`: SGLang's scheduler does not see them either)."""
        self._held += 1
        try:
            await self._unpaused.wait()
        finally:
            self._held -= 1

    async def _admit(self, req: p.GenerateReqInput) -> tuple[list[Sequence], bool]:
        """The request's sequences, or a ValueError naming what SGLang would refuse."""
        unsupported = p.unsupported_fields(req)
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by the embedded engine (SGLang has it)")
        if req.sampling_logprobs_mode is not None:  # SGLang's rule; sampling masks are not served here
            raise ValueError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        for name in ("routed_dp_rank", "data_parallel_rank"):
            rank = getattr(req, name)
            if rank not in (None, 0):  # SGLang's range check; this engine is its only rank
                raise ValueError(f"{name}={rank} out of range [0, 1)")
        prompts, single = requests.split(req, self.engine.max_batch_size)
        for rid in [q.rid for q in prompts] + [r for q in prompts for r in q.sample_rids()]:
            if rid in self._live:
                raise ValueError(f"Duplicate request ID detected: {rid}")
        return await self._sequences(prompts), single

    async def _sequences(self, prompts: list[requests.Prompt]) -> list[Sequence]:
        """The sequences to run, prompt by prompt and sample by sample; a ValueError naming the field
        when a prompt cannot run (nothing has been queued then)."""
        tok = self.engine.tokenizer
        most = self.engine.context_length * self._max_token_chars
        for prompt in prompts:
            # a text too long to fit the context even at the vocabulary's longest token is refused
            # before any tokenization
            if prompt.text is not None and len(prompt.text) > most:
                raise ValueError(f"{prompt.where}: {len(prompt.text)} characters cannot fit the context length "
                                 f"{self.engine.context_length}")
        texts = [q.text for q in prompts if q.text is not None]
        if texts:  # off the event loop: a long prompt would otherwise stall every other request
            # SGLang tokenizes text with the tokenizer's special tokens (a BOS where the model has one)
            encoded = iter(await asyncio.to_thread(lambda: [tok.encode(t) for t in texts]))
            for prompt in prompts:
                if prompt.text is not None:
                    prompt.input_ids = next(encoded)
        seqs = []
        for prompt in prompts:
            window = self._check(prompt)
            for rid in prompt.sample_rids():
                seqs.append(Sequence(
                    rid=rid, prompt=prompt.input_ids or [], params=prompt.params, stop_window=window,
                    input_logprob_start=prompt.logprob_start_len if prompt.return_logprob
                    and prompt.logprob_start_len >= 0 else None, request=prompt,
                    # a dense model has no experts to report: SGLang without its capturer
                    routes_from=prompt.routed_experts_start_len if prompt.return_routed_experts
                    and self.engine.moe is not None else None))
        return seqs

    def _check(self, prompt: requests.Prompt) -> int:
        """Refuse what SGLang refuses for this prompt and settle `max_new_tokens`; returns the
        stop-string window (`Sequence.stop_window`)."""
        sp, ids, where = prompt.params, prompt.input_ids or [], prompt.where
        if sp.top_k == 0 or sp.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {sp.top_k}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ValueError(f"{where}: token {bad[0]} is outside the vocabulary (0..{self.engine.vocab_size - 1})")
        limit = self.engine.context_length
        if len(ids) >= limit:
            raise ValueError(f"{where}: the input ({len(ids)} tokens) is longer than the model's context length "
                             f"({limit} tokens)")
        wanted = sp.max_new_tokens
        if isinstance(wanted, int) and len(ids) + wanted > limit:
            raise ValueError(
                f"sampling_params.max_new_tokens: {len(ids)} prompt tokens + {wanted} new tokens "
                f"exceed the context length {limit}"
            )
        if not isinstance(wanted, int):  # absent: 128 at most; null: to the context's end (SGLang's clamp)
            room = limit - len(ids)
            prompt.params = sp = _with(sp, max_new_tokens=room if wanted is None else min(128, room))
        if prompt.return_logprob and not -1 <= prompt.logprob_start_len <= len(ids):
            raise ValueError(f"logprob_start_len: {prompt.logprob_start_len}, for a prompt of {len(ids)} tokens "
                             "(-1 or 0..the prompt's length)")
        start = prompt.routed_experts_start_len
        if prompt.return_routed_experts and not 0 <= start <= len(ids):  # SGLang's scheduler's rule
            raise ValueError(f"routed_experts_start_len: {start}, for a prompt of {len(ids)} tokens "
                             "(0..the prompt's length)")
        stops = _stops(sp)
        if len(stops) > MAX_STOP_COUNT:
            raise ValueError(f"sampling_params.stop: at most {MAX_STOP_COUNT} stop strings are allowed, "
                             f"got {len(stops)}")
        lengths = [len(self.engine.tokenizer.encode(s, add_special_tokens=False)) for s in stops]
        return max(lengths, default=0) + 1

    async def _run(self, seqs: list[Sequence]) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        futures = []
        for seq in seqs:
            done: asyncio.Future = loop.create_future()
            seq.on_finish = lambda s, f=done: loop.call_soon_threadsafe(_set, f, s)
            futures.append(done)
            self.engine.submit(seq)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: stop decoding for it
            await self._abort(seqs)
            raise

    async def _abort(self, seqs: list[Sequence]) -> None:
        """Abort `seqs` and wait until the engine has (shielded: the caller is being cancelled), so
        that their ids stop being live only once nothing decodes for them."""
        def abort() -> None:
            for seq in seqs:
                self.engine.abort(rid=seq.rid)

        with contextlib.suppress(Exception):
            await asyncio.shield(self.engine.call(abort, asyncio.get_running_loop()))

    async def _stream(self, request: web.Request, req: p.GenerateReqInput, seqs: list[Sequence],
                      single: bool) -> web.StreamResponse:
        """SSE as SGLang's `_stream_batch_responses`: an event per new token of a sample (every
        `stream_interval` tokens; not while its text ends in a partial character or could be starting a
        stop string) with its output so far, its final event as soon as it finishes, `index` (its place
        in the reply) for a batch or n > 1; then `data: [DONE]`."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[Sequence, bool]] = asyncio.Queue()
        index = {seq.rid: i for i, seq in enumerate(seqs)}
        for seq in seqs:
            seq.on_update = lambda s: loop.call_soon_threadsafe(events.put_nowait, (_snapshot(s), False))
            seq.on_finish = lambda s: loop.call_soon_threadsafe(events.put_nowait, (s, True))
        response = await self._event_stream(request)
        tok = self.engine.tokenizer

        async def send(seq: Sequence, finished: bool) -> None:
            out = reply(req, seq, tok, self.engine.weight_version, finished)
            if not finished and held_back(out["text"], _stops(seq.params)):
                return  # the reply's own text: decoding the output a second time per token would double the cost
            if not single:
                out["index"] = index[seq.rid]
            await response.write(b"data: " + dumps(out) + b"\n\n")

        for seq in seqs:
            self.engine.submit(seq)
        left = len(seqs)
        try:
            while left:
                seq, finished = await events.get()
                if finished:
                    left -= 1
                    await send(seq, True)
                    continue
                every = seq.params.stream_interval or 1
                if len(seq.output) % every == 0:
                    await send(seq, False)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            await self._abort(seqs)
            raise
        return response

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        """A stream refused after SGLang's contract check: an error event, then `[DONE]` (HTTP 200)."""
        response = await self._event_stream(request)
        event = {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}
        await response.write(b"data: " + dumps(event) + b"\n\ndata: [DONE]\n\n")
        return response

    @staticmethod
    async def _event_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response


def _stops(sp: p.SamplingParams) -> list[str]:
    return [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])


def _with(sp: p.SamplingParams, **changes: Any) -> p.SamplingParams:
    """A copy of a request's sampling parameters with `changes` (the batch's prompts may share one)."""
    return msgspec.structs.replace(sp, **changes)


def _snapshot(seq: Sequence) -> Sequence:
    """The sequence as it is now: the engine thread keeps appending to the original while the event
    loop writes this update, so each streamed event shows exactly the tokens it announces."""
    return dataclasses.replace(seq, output=list(seq.output), logprobs=list(seq.logprobs),
                               versions=list(seq.versions), on_update=None, on_finish=None)


def _cross_site(request: web.Request) -> str | None:
    """Why a request that a web page on another site made is refused, or None.

    Browsers say where a request comes from: `Sec-Fetch-Site` (every request of a current browser,
    image loads included) and `Origin` (every cross-origin fetch and form post). Programs (our
    clients, SGLang's, curl) send neither, or their own host. Without this, any page the user
    visits could pause a loopback engine or load weights into it (no token is needed on loopback).
    """
    site = request.headers.get("Sec-Fetch-Site", "").lower()
    if site in ("cross-site", "same-site"):
        return f"{request.path}: refused, a browser request from another site (Sec-Fetch-Site: {site})"
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null":
        try:
            host = urllib.parse.urlsplit(origin).netloc
        except ValueError:  # not a URL at all
            host = None
        if host != request.host:
            return f"{request.path}: refused, a browser request from origin {origin!r}, not {request.host!r}"
    elif origin == "null":  # sandboxed frames and file:// pages
        return f"{request.path}: refused, a browser request from an opaque origin"
    return None


async def _read_at_most(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it passes `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while chunk := await request.content.read(2**16):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _set(future: asyncio.Future, seq: Sequence) -> None:
    if not future.done():
        future.set_result(seq)
