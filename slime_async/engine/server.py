"""The embedded engine's HTTP server: SGLang's endpoints, field names and response shapes.

Responses follow SGLang 0.5.23's `http_server.py` and tokenizer manager: `/generate` returns
`{text, output_ids, meta_info}` (a list of them for n > 1), with `meta_info` holding `id`,
`finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`, `output_token_logprobs`
(`[logprob, token_id, text]` triples), `weight_version` and `weight_versions`. Errors are a 400
with `{"error": {"message": ...}}` naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import urllib.parse
import uuid
from typing import Any

import torch
from aiohttp import web

from slime_async.config.schema import is_loopback_host as is_loopback
from slime_async.engine import protocol as p
from slime_async.engine import requests
from slime_async.engine.core import Engine, Sequence, version_spans
from slime_async.engine.weights import decode_named_tensors, read_checkpoint

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


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class EngineServer:
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
        r.add_route("*", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/release_memory_occupation", self.release_memory_occupation)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory_occupation)
        r.add_post("/init_weights_update_group", self.unsupported_distributed)
        r.add_post("/update_weights_from_distributed", self.unsupported_distributed)
        self.started = time.time()
        self._weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values()) + 2**20
        """The most shared memory one update item may map: the model's own weights (and a little)."""
        self._shared_since = time.time()
        """Shared-memory files older than this were not made for the next update (`shared_tensors`)."""
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
        """A replacement engine (started with a non-numeric weight version, e.g. `pending`) serves nothing
        until the trainer's weights arrive with a version: 503 on /health and /generate till then."""
        if self.engine.weight_version.lstrip("-").isdigit():
            return None
        return error(503, f"weight version {self.engine.weight_version!r}: waiting for the trainer's weights")

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:  # it would never answer a /generate again
            return web.Response(status=503, text="the engine's loop has stopped")
        return self._awaiting_weights() or web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        seq = Sequence(rid=f"health-{uuid.uuid4().hex}", prompt=[0],
                       params=p.SamplingParams(max_new_tokens=1, temperature=0.0))
        seqs = await self._run([seq])
        return web.Response(status=200 if seqs else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response({
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
            "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting), "paused": e.paused,
            "decode_steps": e.steps, "generated_tokens": e.generated_tokens, "finished_reqs": e.finished,
            "aborted_reqs": e.aborted, "memory_released": sorted(e.released),
            "startup_time": self.started, "effective_max_running_requests_per_dp": e.max_batch_size,
        }
        return web.json_response({
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
        try:
            req = p.decode_body(body, p.GenerateReqInput)
            unsupported = p.unsupported_fields(req)
            if unsupported:
                raise ValueError(f"{', '.join(unsupported)}: not supported by the embedded engine (SGLang has it)")
            prompts, single = requests.split(req, self.engine.max_batch_size)
            seqs = await self._sequences(req, prompts)
        except ValueError as exc:
            return error(400, str(exc))
        if req.stream:
            return await self._stream(request, req, seqs, single)
        done = await self._run(seqs)
        outs = [self._output(req, s) for s in done]
        return web.json_response(outs[0] if single else outs)

    async def _sequences(self, req: p.GenerateReqInput, prompts: list[requests.Prompt]) -> list[Sequence]:
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
            encoded = iter(await asyncio.to_thread(
                lambda: [tok.encode(t, add_special_tokens=False) for t in texts]))
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
                    and prompt.logprob_start_len >= 0 else None, request=prompt))
        return seqs

    def _check(self, prompt: requests.Prompt) -> int:
        """Refuse what SGLang refuses for this prompt; the stop-string window (`Sequence.stop_window`)."""
        sp, ids, where = prompt.params, prompt.input_ids or [], prompt.where
        if sp.top_k == 0 or sp.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {sp.top_k}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ValueError(f"{where}: token {bad[0]} is outside the vocabulary (0..{self.engine.vocab_size - 1})")
        limit = self.engine.context_length
        if len(ids) + sp.max_new_tokens > limit:
            raise ValueError(
                f"sampling_params.max_new_tokens: {len(ids)} prompt tokens + {sp.max_new_tokens} new tokens "
                f"exceed the context length {limit}"
            )
        if prompt.return_logprob and not -1 <= prompt.logprob_start_len <= len(ids):
            raise ValueError(f"logprob_start_len: {prompt.logprob_start_len}, for a prompt of {len(ids)} tokens "
                             "(-1 or 0..the prompt's length)")
        stops = [sp.stop] if isinstance(sp.stop, str) else sp.stop or []
        if len(stops) > MAX_STOP_COUNT:
            raise ValueError(f"sampling_params.stop: at most {MAX_STOP_COUNT} stop strings are allowed, "
                             f"got {len(stops)}")
        lengths = [len(self.engine.tokenizer.encode(s, add_special_tokens=False)) for s in stops]
        return max(lengths, default=0) + 1

    async def _run(self, seqs: list[Sequence], on_update: Any = None) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        futures = []
        for seq in seqs:
            done: asyncio.Future = loop.create_future()
            seq.on_finish = lambda s, f=done: loop.call_soon_threadsafe(_set, f, s)
            seq.on_update = on_update
            futures.append(done)
            self.engine.submit(seq)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: stop decoding for it

            def abort() -> None:
                for seq in seqs:
                    self.engine.abort(rid=seq.rid)

            self.engine.call(abort)
            raise

    def _output(self, req: p.GenerateReqInput, seq: Sequence) -> dict[str, Any]:
        """SGLang's reply for one sample: text (the matched stop trimmed off), output ids, meta_info."""
        tok = self.engine.tokenizer
        prompt: requests.Prompt | None = seq.request
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(seq.output),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "num_retractions": seq.retractions,
            "e2e_latency": time.monotonic() - seq.created,
        }
        if prompt is not None and prompt.return_logprob:
            words = req.return_text_in_logprobs
            meta["input_token_logprobs"] = [[lp, t, tok.decode([t]) if words else None]
                                            for lp, t in seq.input_logprobs or []]
            texts = [tok.decode([t]) for t in seq.output] if words else None
            meta["output_token_logprobs"] = [
                [lp, t, texts[i] if texts else None] for i, (lp, t) in enumerate(zip(seq.logprobs, seq.output,
                                                                                     strict=True))
            ]
            meta["output_token_logprobs_length"] = len(seq.output)
        spans = version_spans(seq.versions) or [{"version": self.engine.weight_version, "start": 0, "end": 0}]
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
        return {"text": _text(tok, seq), "output_ids": list(seq.output), "meta_info": meta}

    async def _stream(self, request: web.Request, req: p.GenerateReqInput, seqs: list[Sequence],
                      single: bool) -> web.StreamResponse:
        """SSE: one `data: {...}` event per new token of a sample with its output so far (and, for a
        batch or n > 1, its `index` in the reply), then `data: [DONE]`."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Sequence] = asyncio.Queue()
        index = {seq.rid: i for i, seq in enumerate(seqs)}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        task = asyncio.ensure_future(
            self._run(seqs, on_update=lambda s: loop.call_soon_threadsafe(updates.put_nowait, _snapshot(s))))

        async def send(seq: Sequence) -> None:
            out = self._output(req, seq)
            if not single:
                out["index"] = index[seq.rid]
            await response.write(b"data: " + json.dumps(out).encode() + b"\n\n")

        try:
            while not task.done():
                getter = asyncio.ensure_future(updates.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    await send(getter.result())
                else:
                    getter.cancel()
            while not updates.empty():  # updates queued before the end: none is skipped
                await send(updates.get_nowait())
            for seq in task.result():
                await send(seq)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            task.cancel()
            raise
        return response

    # --- control ------------------------------------------------------------------------

    async def _body(self, request: web.Request, type: Any) -> Any:
        return p.decode_body(await request.read(), type)

    async def _engine_call(self, fn: Any) -> Any:
        return await self.engine.call(fn, asyncio.get_running_loop())

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.AbortReq)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(lambda: self.engine.abort(req.rid or "", req.abort_all))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache outlives a request yet, so there is nothing to flush.
        return web.Response(text="Cache flushed.\n", status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.PauseGenerationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(lambda: self.engine.pause(req.mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self._body(request, p.ContinueGenerationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(self.engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.ReleaseMemoryOccupationReqInput)
            before = _device_gib()
            await self._engine_call(lambda: self.engine.release_memory(req.tags))
        except ValueError as exc:
            return error(400, str(exc))
        # in the engine's log: when, and what a colocated trainer gains
        gained = f": {before:.2f} -> {_device_gib():.2f} GiB allocated" if before is not None else ""
        print(f"released {req.tags or 'all'}{gained}", flush=True)
        return web.json_response(None)  # SGLang's handler answers nothing on success

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.ResumeMemoryOccupationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(lambda: self.engine.resume_memory(req.tags))
        return web.json_response(None)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightFromDiskReqInput)
            _refuse(p.refused_update_fields(req))
            tensors = await asyncio.to_thread(read_checkpoint, req.model_path)
        except ValueError as exc:
            return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
        ok, message = await self._update(tensors, req.weight_version, req.abort_all_requests)
        return web.json_response({"success": ok, "message": message, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightsFromTensorReqInput)
            _refuse(p.refused_update_fields(req))
            arrived = time.time()
            tensors = await asyncio.to_thread(decode_named_tensors, req.serialized_named_tensors, self._weight_bytes,
                                              self._shared_since)
        except ValueError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        ok, message = await self._update(tensors, req.weight_version, req.abort_all_requests)
        if ok:  # the next update's shared files are made after this one arrived
            self._shared_since = arrived
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def _update(self, tensors: dict[str, torch.Tensor], version: str | None, abort_all: bool) -> tuple[bool, str]:
        def apply() -> int:
            if abort_all:
                self.engine.abort(abort_all=True)
            return self.engine.load_weights(tensors, version)

        try:
            n = await self._engine_call(apply)
        except ValueError as exc:
            return False, f"weights not updated: {exc}"
        return True, f"Succeeded to update {n} tensors; weight version {self.engine.weight_version}."

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightVersionReqInput)
        except ValueError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)

        def apply() -> None:
            if req.abort_all_requests:
                self.engine.abort(abort_all=True)
            self.engine.set_version(req.new_version)

        await self._engine_call(apply)
        return web.json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                                  "new_version": req.new_version})

    async def unsupported_distributed(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"success": False, "message": f"{request.path} (NCCL weight broadcast) is not supported by the "
             "embedded engine; use update_weights_from_tensor or update_weights_from_disk"}, status=501)


def _refuse(reasons: list[str]) -> None:
    if reasons:
        raise ValueError("; ".join(reasons))


def _text(tokenizer: Any, seq: Sequence) -> str:
    """SGLang's detokenizer (`trim_matched_stop`): a matched stop token is left out of the text, and
    the text is cut before the first occurrence of a matched stop string, unless `no_stop_trim`."""
    sp = seq.params
    matched = (seq.finish_reason or {}).get("matched")
    ids = seq.output
    if isinstance(matched, int) and not sp.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    if isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[: pos + len(matched)] if sp.no_stop_trim else text[:pos]
    return text


def _snapshot(seq: Sequence) -> Sequence:
    """The sequence as it is now: the engine thread keeps appending to the original while the event
    loop writes this update, so each streamed event shows exactly the tokens it announces."""
    return dataclasses.replace(seq, output=list(seq.output), logprobs=list(seq.logprobs),
                               versions=list(seq.versions), on_update=None, on_finish=None)


def _device_gib() -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


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
