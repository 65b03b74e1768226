"""Publishing the trainer's weights to every engine, in place, over SGLang's HTTP API.

One push to one engine: `/pause_generation {mode: in_place}` -> every bucket to
`/update_weights_from_tensor` (or the version's directory to `/update_weights_from_disk`; the version
only on the last) -> `/continue_generation`. Each request is applied by the engine all or nothing;
the pause makes the whole push so: no token is generated from a mix of two versions, and an engine
whose push failed half-way stays paused (it never serves half-updated weights) until a retry, the
next publish or `reconcile` completes it. The pause is needed even for one bucket: SGLang applies an
update on an unpaused engine only once every running request has finished (its model-update lock),
which would stall generation for the longest one. Requests paused in place keep their KV cache, so
`flush_cache` is false: SGLang refuses a flush while requests run (the update would answer
`success: false`). A failed push is retried from the start (the whole push, never the rest of one).

Under `rollout.partial_mode: abort` (the default with SGLang engines) the pause ends the requests in
flight instead (`{mode: abort}`; the rollout client resends each with its partial output), so nothing
runs while the engine is paused and `/flush_cache` then drops its radix cache before it resumes: the
prefixes cached under the old weights (a group's prompt, an episode's earlier turns, the system
prompt every request shares) are recomputed by the new ones. Seen on a real SGLang 0.5.17 (H100,
`bench sglang_gpu`): after an in-place push, prompts scored before it were served from 15 of their
32 tokens cached, and their logprobs stayed 0.13 (mean) from the trainer's, against 5e-4 on the
embedded engine, which keeps no prefix past its request.

An engine's version is what its `/get_model_info` reports (`weight_version`, the decimal number of
optimizer steps). An engine that missed an update (it was down, or restarted with its initial
weights) reports an older version: `publish` pushes to every engine anyway and counts it, and
`reconcile` finds and updates such engines between publishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec
import torch

from slime_async.config.engine_kinds import engine_kind as engine_kind_of
from slime_async.config.schema import LoraConfig, SyncConfig
from slime_async.sync.adapters import prepare_adapters
from slime_async.sync.disk import prepare_disk, prune_versions
from slime_async.sync.push import NamedWeights, Prepared, PushError
from slime_async.sync.tensor import prepare_tensor

log = logging.getLogger(__name__)

FLUSH_WAIT_S = 5.0
"""How long an engine's flush may wait for the requests that an abort ended to leave (SGLang's
`/flush_cache?timeout=`); SGLang's abort-mode pause returns once none holds the model, so at once."""

@dataclass
class PublishReport:
    version: int
    seconds: float
    """Wall time of the whole publish (version checks, serialisation, every engine's push)."""
    bytes: int
    buckets: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Engines still not on `version` after all retries, with the last error."""
    missed: list[str] = field(default_factory=list)
    """Engines found on an older version than the previous publish (they had missed an update)."""
    attempts: int = 0
    flushed: list[str] = field(default_factory=list)
    """Engines whose cached prefixes were dropped after the update (`rollout.partial_mode: abort`)."""
    prepare_seconds: float = 0.0
    """Of `seconds`, the trainer side's serialisation (tensor: safetensors bodies or shared handles;
    disk: the file)."""


class WeightPublisher:
    """Pushes weights to a fixed list of engine URLs. Use as `async with WeightPublisher(...) as pub`
    (or call `close()` when done)."""

    def __init__(
        self,
        urls: list[str],
        cfg: SyncConfig,
        *,
        disk_dir: Path | None = None,
        admin_token: str | None = None,
        engine_tp_size: int = 1,
        engine_kind: str = "sglang",
        lora: LoraConfig | None = None,
        base_model: str = "",
        partial_mode: Literal["in_place", "abort"] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("sync: no engine URLs to publish weights to")
        if cfg.mode == "disk" and disk_dir is None:
            raise ValueError("sync.mode=disk needs a directory (sync.disk_dir) that the engines can read")
        self.kind = engine_kind_of(engine_kind)
        """The engines' routes and what they take (`config.engine_kinds`)."""
        if cfg.mode not in self.kind.sync_modes:
            raise ValueError(f"sync.mode={cfg.mode}: {self.kind.label} engines take sync.mode "
                             f"{' or '.join(self.kind.sync_modes)} here ({self.kind.sync_note}); "
                             f"set sync.mode: {self.kind.sync_modes[0]}")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.adapters = lora if lora is not None and self.kind.lora_adapters else None
        """A LoRA run's adapters go to these engines as adapters (`sync.adapters`): the weights
        given to `publish` are then the adapters under peft's names."""
        self.base_model = base_model
        """The model the adapters apply to (`adapter_config.json`'s `base_model_name_or_path`)."""
        partial_mode = partial_mode or self.kind.default_partial_mode  # None: as `rollout.partial_mode`
        self.pause_how = ((self.kind.abort_pause_route, dict(self.kind.abort_pause_body)) if partial_mode == "abort"
                          else (self.kind.pause_route, dict(self.kind.pause_body)))
        """`rollout.partial_mode`: requests in flight at a push go on under the new weights (in place) or
        end there with their partial output, which the rollout client resends (abort)."""
        self.flush_route = self.kind.flush_route if partial_mode == "abort" else None
        """Aborting leaves nothing running, so the engine's cached prefixes (KV of the old weights) can be
        dropped before it resumes; paused in place, SGLang refuses that (see `EngineKind.stale_prefixes_in_place`)."""
        self.disk_dir = disk_dir
        self.engine_tp_size = engine_tp_size
        """SGLang reads item `tp_rank` of `serialized_named_tensors`: a shared push sends one per rank."""
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.published: int | None = None
        """The last version every engine confirmed (None before the first publish)."""
        self._session: aiohttp.ClientSession | None = None
        self._nccl: Any = None
        self._paused: set[str] = set()
        self._flushed: set[str] = set()
        """Engines flushed during the current publish (`PublishReport.flushed`)."""
        self._started = False
        """Whether `reconcile` has run once (see there)."""
        self._no_shared: set[str] = set()
        """Engines that could not open shared tensors (another host or GPU): they get safetensors."""
        """Engines this publisher paused and has not resumed yet (a push failed half-way)."""

    async def __aenter__(self) -> WeightPublisher:
        _ = self.session
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use (inside the running loop); `close()` (or leaving `async with`) ends it."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        return self._session

    # --- HTTP ---------------------------------------------------------------------------

    async def _post(self, url: str, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        """POST a JSON body (a dict, or one already encoded); PushError names the engine and endpoint."""
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        try:
            async with self.session.post(url + path, data=data,
                                         headers={**self.headers, "Content-Type": "application/json"}) as r:
                text = await r.text()
                status = r.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise PushError(f"{url}{path}: {type(exc).__name__}: {exc}") from None
        try:
            out = json.loads(text) if text.strip().startswith("{") else {"message": text}
        except ValueError:
            out = {"message": text}
        if status != 200 or out.get("success") is False:
            message = out.get("message") or (out.get("error") or {}).get("message") or text
            raise PushError(f"{url}{path}: HTTP {status}: {message}", retryable=status != 501)
        return out

    async def post(self, url: str, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        """POST to one engine's route (for the push modes in other modules: `nccl`, `vllm`)."""
        return await self._post(url, path, body)

    async def pause(self, url: str) -> None:
        """Pause one engine for a push (in place, or aborting what runs: `pause_how`) and remember it:
        `_push_with_retries` lets it go on once the push is whole (see the module's docstring)."""
        route, body = self.pause_how
        await self._post(url, route, body)
        self._paused.add(url)

    async def engine_version(self, url: str) -> int | None:
        """The version an engine reports, or None when it cannot be reached or reports no number."""
        try:
            async with self.session.get(url + self.kind.version_route,
                                        headers=self.headers) as r:
                if r.status != 200:
                    return None
                info = await r.json()
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        try:
            return int(info.get("weight_version"))
        except (TypeError, ValueError):
            return None

    async def engine_versions(self) -> dict[str, int | None]:
        versions = await asyncio.gather(*(self.engine_version(u) for u in self.urls))
        return dict(zip(self.urls, versions, strict=True))

    async def set_version(self, version: int) -> None:
        """Stamp `version` on every engine without new weights (e.g. after a resume that loaded them)."""
        body: dict[str, Any] = {"new_version": str(version), **self.kind.version_stamp}
        await asyncio.gather(*(self._post(u, "/update_weight_version", body) for u in self.urls))

    # --- sharing the GPUs with the trainer ------------------------------------------------

    async def release_memory(self) -> list[str]:
        """Every engine stops generating (running requests go back to its queue: mode retract, as
        SGLang requires an idle engine) and gives its GPU memory back. Returns the engines that did;
        one that is down or refuses is logged and left to `restore_memory` / `reconcile`."""
        async def one(url: str) -> None:
            await self._post(url, "/pause_generation", {"mode": "retract"})
            await self._post(url, "/release_memory_occupation", {})

        return await self._each(one, "release memory")

    async def restore_memory(self, weights: NamedWeights, version: int) -> PublishReport:
        """Undo `release_memory`: take the memory back, push `version`'s weights (SGLang's released
        weights hold nothing until then) and let the engines generate again."""
        await self._each(lambda url: self._post(url, "/resume_memory_occupation", {}), "resume memory")
        report = await self.publish(weights, version)
        await self._each(lambda url: self._post(url, "/continue_generation", {}), "continue generation")
        return report

    async def _each(self, call: Callable[[str], Any], what: str) -> list[str]:
        results = await asyncio.gather(*(call(u) for u in self.urls), return_exceptions=True)
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s on %s failed: %s", what, url, result)
        return [u for u, r in zip(self.urls, results, strict=True) if not isinstance(r, BaseException)]

    # --- publishing -----------------------------------------------------------------------

    async def publish(self, weights: NamedWeights, version: int, urls: list[str] | None = None) -> PublishReport:
        """Push the weights that `weights()` yields to every engine (or `urls`) as `version`."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        targets = [u.rstrip("/") for u in urls] if urls is not None else self.urls
        start = time.perf_counter()
        before = await asyncio.gather(*(self.engine_version(u) for u in targets))
        missed = [u for u, v in zip(targets, before, strict=True)
                  if self.published is not None and v is not None and v < self.published]
        for u in missed:
            log.warning("engine %s reports version older than %s: it missed an update; bringing it up to date",
                        u, self.published)
        prepared = time.perf_counter()
        self._flushed.clear()
        push, nbytes, nbuckets = await self._prepare(weights, version)
        prepare_seconds = time.perf_counter() - prepared
        results = await asyncio.gather(*(self._push_with_retries(push, u) for u in targets))
        if self.cfg.mode == "tensor" and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # free what the engines' handles kept alive, now that they let go
        report = PublishReport(version=version, seconds=0.0, bytes=nbytes, buckets=nbuckets, missed=missed,
                               prepare_seconds=prepare_seconds, flushed=[u for u in targets if u in self._flushed])
        for url, (attempts, error) in zip(targets, results, strict=True):
            report.attempts += attempts
            if error is None:
                report.updated.append(url)
            else:
                report.failed[url] = error
        if not report.failed and urls is None:
            self.published = version
        if self.cfg.mode == "disk" and self.disk_dir is not None:
            await asyncio.to_thread(prune_versions, self.disk_dir, self.cfg.keep_disk_versions)
        report.seconds = time.perf_counter() - start
        return report

    async def reconcile(self, weights: NamedWeights, version: int) -> list[str]:
        """Find engines not on `version` and push to them; returns the URLs that were behind.

        The first reconcile of a publisher (a trainer starting) then lets every engine that was not
        behind generate again: a trainer killed between a push's last update and its
        `/continue_generation` left an engine paused on the current version (one a push failed half
        way is behind, and the push above completes it)."""
        versions = await self.engine_versions()
        behind = [u for u, v in versions.items() if v != version]
        if behind:
            report = await self.publish(weights, version, urls=behind)
            if report.failed:
                log.warning("reconcile: engines still behind version %s: %s", version, report.failed)
        if not self._started:
            self._started = True
            path = self.kind.resume_route
            others = [u for u in versions if u not in behind]
            await asyncio.gather(*(self._resume(u, path) for u in others))
        return behind

    async def _resume(self, url: str, path: str) -> None:
        try:
            await self._post(url, path, {})
        except PushError as exc:  # down or restarting: it starts unpaused, or the next reconcile finds it
            log.warning("resume generation on %s failed: %s", url, exc)

    async def _prepare(self, weights: NamedWeights, version: int) -> Prepared:
        """Serialise once for all engines; returns the per-engine push coroutine factory. One module per
        mode: `sync.tensor`, `sync.disk`, `sync.nccl`."""
        mode = self.cfg.mode
        limit = int(self.cfg.bucket_mb * 1024 * 1024)
        if mode == "tensor":
            return await prepare_tensor(self, weights, version, limit, self._no_shared)
        if mode == "disk":
            assert self.disk_dir is not None
            if self.adapters is not None:
                return await prepare_adapters(self, weights, version, self.disk_dir, self.adapters, self.base_model)
            return await prepare_disk(self, weights, version, self.disk_dir)
        if mode == "nccl":
            from slime_async.sync.nccl import NcclBroadcaster, prepare_nccl

            if self._nccl is None:
                self._nccl = NcclBroadcaster(self, self.cfg)
            return prepare_nccl(self._nccl, weights, version, limit)
        raise ValueError(f"sync.mode: expected tensor, disk or nccl, got {mode!r}")

    async def _flush(self, url: str) -> None:
        """Drop the engine's cached prefixes (it is paused with nothing running: aborted). A refusal
        (something still runs after `FLUSH_WAIT_S`) is logged and the push stands: the weights are in."""
        try:
            await self._post(url, f"{self.flush_route}?timeout={FLUSH_WAIT_S}", {})
            self._flushed.add(url)
        except PushError as exc:
            log.warning("engine %s: cached prefixes not flushed after the update (%s); requests that share "
                        "them reuse KV computed by earlier weights until it idles", url, exc)

    async def _push_with_retries(self, push: Callable[[str], Any], url: str) -> tuple[int, str | None]:
        """(attempts made, last error or None)."""
        error = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                # backoff before retrying a refused or failed push (not a wait on a condition)
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
            try:
                await push(url)
                if self.flush_route is not None and url in self._paused:
                    await self._flush(url)
                if url in self._paused:  # whole again: serve (also after an earlier half-done push)
                    await self._post(url, self.kind.resume_route, {})
                    self._paused.discard(url)
                return attempt + 1, None
            except PushError as exc:
                error = str(exc)
                if not exc.retryable:
                    return attempt + 1, error
                log.warning("weight push to %s failed (attempt %d of %d): %s",
                            url, attempt + 1, self.cfg.retries + 1, error)
        return self.cfg.retries + 1, error
