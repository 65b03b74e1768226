"""The embedded engine's control endpoints: pause, abort, cache, memory and weight updates, as SGLang's.

SGLang 0.5.23's rules (`http_server.py`, `tokenizer_manager.py`, `tokenizer_control_mixin.py`,
`scheduler_components/weight_updater.py`), each kept here:
- a weight update on an engine that is not paused takes the model-update lock as writer: it waits for
  the running requests to finish and holds new ones (the lock prefers writers); on a paused engine it
  applies at once, between decode steps;
- `flush_cache` (an update's, by default, or `/flush_cache`'s) is refused while requests run or, unless
  paused, wait: an update then applies its weights and answers `success: false` saying so;
- a paused engine holds new `/generate` requests before checking them, until `/continue_generation`;
- `/abort_request` acts only on the id of a live request (then on every request whose id starts with
  it, the scheduler's prefix match), or on all;
- every control body is required (an empty body is a 400) and its unknown keys are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch
from aiohttp import web

from slime_async.engine import protocol as p
from slime_async.engine.replies import error, json_response
from slime_async.engine.weights import read_checkpoint
from slime_async.weight_wire.codec import decode_named_tensors

NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")
"""SGLang's words for an update whose flush was refused (`flush_cache_after_weight_update`)."""

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


class ControlRoutes:
    """The control handlers of `EngineServer` (it provides `engine`, `_unpaused`, `_update_lock`,
    `_live`, `_weight_bytes` and `_shared_since`)."""

    engine: Any
    _unpaused: asyncio.Event
    _update_lock: Any
    _live: set[str]
    _weight_bytes: int
    _shared_since: float

    def add_control_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/abort_request", self.abort_request)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
            r.add_route(method, "/release_memory_occupation", self.release_memory_occupation)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory_occupation)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/init_weights_update_group", self.unsupported_distributed)
        r.add_post("/update_weights_from_distributed", self.unsupported_distributed)

    async def _body(self, request: web.Request, type: Any) -> Any:
        data = await request.read()
        if not data.strip():  # FastAPI's Body(): SGLang answers a missing body with 400
            raise ValueError(f"{request.path}: a JSON body ({type.__name__}) is required")
        return p.decode_body(data, type)

    async def _engine_call(self, fn: Any) -> Any:
        return await self.engine.call(fn, asyncio.get_running_loop())

    def _idle(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)`: nothing running, and nothing waiting unless
        paused (read on the engine thread)."""
        return not self.engine.running and (self.engine.paused or not self.engine.waiting)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.AbortReq)
        except ValueError as exc:
            return error(400, str(exc))
        rid = req.rid or ""
        if req.abort_all or rid in self._live:
            await self._engine_call(lambda: self.engine.abort(rid, req.abort_all))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache outlives a request here, so a flush has nothing to drop; it is refused as
        SGLang's is while requests run (after waiting up to `?timeout=` seconds for them)."""
        try:
            timeout = float(request.query.get("timeout", "0"))
            if not timeout >= 0:
                raise ValueError
        except ValueError:
            return error(400, f"timeout: {request.query.get('timeout')!r} is not a number >= 0")
        deadline = time.monotonic() + timeout
        while not await self._engine_call(self._idle):
            if time.monotonic() >= deadline:
                return web.Response(text="Flush cache failed.\n", status=400)
            await asyncio.sleep(0.05)
        return web.Response(text=FLUSHED, status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.PauseGenerationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        self._unpaused.clear()
        await self._engine_call(lambda: self.engine.pause(req.mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self._body(request, p.ContinueGenerationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(self.engine.resume)
        self._unpaused.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

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
        return json_response(None)  # SGLang's handler answers nothing on success

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.ResumeMemoryOccupationReqInput)
        except ValueError as exc:
            return error(400, str(exc))
        await self._engine_call(lambda: self.engine.resume_memory(req.tags))
        return json_response(None)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightFromDiskReqInput)
            _refuse(p.refused_update_fields(req))
            tensors = await asyncio.to_thread(read_checkpoint, req.model_path)
        except ValueError as exc:
            return json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
        ok, message = await self._update(tensors, req.weight_version, req.abort_all_requests, req.flush_cache)
        return json_response({"success": ok, "message": message, "num_paused_requests": 0}, status=200 if ok else 400)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightsFromTensorReqInput)
            _refuse(p.refused_update_fields(req))
            arrived = time.time()
            tensors = await asyncio.to_thread(decode_named_tensors, req.serialized_named_tensors, self._weight_bytes,
                                              self._shared_since)
        except ValueError as exc:
            return json_response({"success": False, "message": str(exc)}, status=400)
        ok, message = await self._update(tensors, req.weight_version, req.abort_all_requests, req.flush_cache)
        if ok:  # the next update's shared files are made after this one arrived
            self._shared_since = arrived
        return json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def _update(self, tensors: dict[str, torch.Tensor], version: str | None, abort_all: bool,
                      flush: bool) -> tuple[bool, str]:
        if abort_all:
            await self._engine_call(lambda: self.engine.abort(abort_all=True))

        def apply() -> bool:
            self.engine.load_weights(tensors, version)
            return not flush or self._idle()

        paused = not self._unpaused.is_set()
        # SGLang: a paused engine updates at once; otherwise the update waits for the running requests
        async with contextlib.nullcontext() if paused else self._update_lock.writer_lock:
            try:
                flushed = await self._engine_call(apply)
            except ValueError as exc:
                return False, f"weights not updated: {exc}"
        if not flushed:
            return False, NOT_FLUSHED
        return True, "Succeeded to update model weights." + (
            f" Weight version updated to {version}." if version is not None else "")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, p.UpdateWeightVersionReqInput)
        except ValueError as exc:
            return json_response({"success": False, "message": str(exc)}, status=400)

        def apply() -> None:
            if req.abort_all_requests:
                self.engine.abort(abort_all=True)
            self.engine.set_version(req.new_version)

        await self._engine_call(apply)
        return json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                              "new_version": req.new_version})

    async def unsupported_distributed(self, request: web.Request) -> web.Response:
        return json_response(
            {"success": False, "message": f"{request.path} (NCCL weight broadcast) is not supported by the "
             "embedded engine; use update_weights_from_tensor or update_weights_from_disk"}, status=501)


def _refuse(reasons: list[str]) -> None:
    if reasons:
        raise ValueError("; ".join(reasons))


def _device_gib() -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
