"""The SGLang client: token-in/token-out `/generate` over aiohttp against one or many servers.

One aiohttp session for all episodes of a worker. Each episode sticks to one server (its prefix
stays in that server's cache) until that server fails; new episodes go to the healthy server with
the fewest outstanding requests. Connection errors, 5xx answers, malformed answers and timeouts
are retried with exponential backoff, failing the episode over to another server by resending its
tokens; a request that the caller cancels, or that times out, is aborted on the server so that it
does not keep decoding. A request the server aborts by itself (a weight update in abort mode) is
resumed by resending prompt + partial output, so the episode keeps every token with its version.
Behind `sglang-router`, give the router's URL as the only server.

The request path is the rollout side's hottest code (one call per turn): bodies are encoded and
answers decoded by msgspec into typed structs (no dict-of-lists walk), per-token arrays are
built straight from the decoded answer, and request ids are a per-client random prefix plus a
counter (unique without a `uuid4` syscall per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np

from slime_async.env.policy import ServerError
from slime_async.moe.routing import decode_sglang
from slime_async.rollout.throttle import Throttled
from slime_async.types.arrays import LOGPROB_DTYPE, TOKEN_DTYPE, VERSION_DTYPE

log = logging.getLogger(__name__)


_JSON = {"Content-Type": "application/json"}


class _Span(msgspec.Struct):
    """SGLang's per-token version span (`sglang/srt/utils/weight_versions.py`)."""

    version: str | int
    start: int
    end: int


class _Meta(msgspec.Struct):
    output_token_logprobs: list[tuple[float, int, Any]]
    """[logprob, token id, text or null] per output token (SGLang's `return_logprob`)."""
    finish_reason: dict[str, Any] | None = None
    weight_version: str | int | None = None
    weight_versions: list[_Span] | None = None
    routed_experts: str | None = None
    """base64 int32 [positions, layers, top_k] when asked for (`slime_async.moe.routing`)."""


class _Answer(msgspec.Struct):
    """The fields of a `/generate` answer the client uses; the rest are skipped by the decoder."""

    output_ids: list[int]
    meta_info: _Meta


class _ScoreMeta(msgspec.Struct):
    input_token_logprobs: list[tuple[float | None, int, Any]]
    """[logprob or null, token id, text or null] per prompt token from `logprob_start_len` on."""


class _ScoreAnswer(msgspec.Struct):
    meta_info: _ScoreMeta


_DECODER = msgspec.json.Decoder(_Answer)
_SCORE_DECODER = msgspec.json.Decoder(list[_ScoreAnswer])
_ENCODER = msgspec.json.Encoder()
_EMPTY_IDS = np.zeros(0, TOKEN_DTYPE)


class BadResponse(ValueError):
    """A server answered, but not with a usable /generate response (counted, then retried elsewhere)."""


@dataclass
class ServerReply:
    """What one server call produced: tokens, behaviour logprobs and the version of each token, and which
    server answered (the env side's `env.Generation` is what a `Policy` returns)."""

    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    """SGLang's finish type: stop, length or abort."""
    server: str
    resumed: int = 0
    """How many times the request was resumed after the server aborted it (weight updates)."""
    routed_experts: np.ndarray | None = None
    """With `routed_from`: int32 expert ids, flat, for the fed positions `routed_from` to the
    last-but-one token of prompt + output (SGLang's `meta_info.routed_experts`); None if not asked."""


@dataclass(frozen=True)
class EngineLoad:
    """Requests of the healthy engines, summed (SGLang's `/v1/loads` per engine, over its ranks)."""

    running: int
    """Decoding now (holding a batch slot)."""
    waiting: int
    """Queued for the next batch: beside full slots the engine is saturated; beside free ones it is
    pacing its prefills (a token budget per step)."""
    engines: int
    """Engines that answered."""
    capacity: int | None = None
    """Their batch slots together (SGLang's `max_running_requests`); None when one did not say (vLLM)."""


@dataclass
class Server:
    url: str
    outstanding: int = 0
    healthy: bool = True
    failures: int = 0
    latencies: list[float] = field(default_factory=list)


@dataclass
class ClientStats:
    requests: int = 0
    retries: int = 0
    failovers: int = 0
    resumes: int = 0
    aborts_sent: int = 0
    errors: Counter = field(default_factory=Counter)


class SGLangClient:
    """Use as `async with SGLangClient(urls) as client: gen = await client.generate(ids, params, episode=...)`."""

    def __init__(
        self,
        urls: list[str],
        *,
        max_connections: int = 1024,
        request_timeout: float = 600.0,
        retries: int = 4,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        unhealthy_after: int = 2,
        health_interval: float = 2.0,
        max_resumes: int = 16,
        admin_token: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("engine urls: at least one server URL is needed")
        self.servers = {u.rstrip("/"): Server(u.rstrip("/")) for u in urls}
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.unhealthy_after = unhealthy_after
        self.health_interval = health_interval
        self.max_resumes = max_resumes
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        """`/abort_request` is an admin endpoint: engines with an admin token refuse it without."""
        self.latest_version = -1
        self._warn = Throttled(log)
        """Highest weight version any server reported (the weight-sync protocol's stamp)."""
        self.stats = ClientStats()
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._rid_prefix = uuid.uuid4().hex[:16] + "-"
        self._rid_count = itertools.count()
        self._sticky: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._version_listeners: list[Any] = []
        self._background: set[asyncio.Future] = set()

    async def __aenter__(self) -> SGLangClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector)
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._background:  # pending aborts must reach the servers before the session closes
            await asyncio.wait(self._background, timeout=10)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()

    def on_version(self, callback: Any) -> None:
        """Call `callback(version)` (sync or async) whenever a server reports a newer weight version."""
        self._version_listeners.append(callback)

    def release(self, episode: str) -> None:
        """Forget an episode's server (call when the episode ends)."""
        self._sticky.pop(episode, None)

    # --- generation ---------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int] | np.ndarray, sampling_params: dict[str, Any], *, episode: str | None = None,
        routed_from: int | None = None,
    ) -> ServerReply:
        """One model call. Raises ServerError when every retry on every server failed.

        With `routed_from`, the server reports the experts it routed each fed position to, from that
        position on (an MoE model's routing replay; `slime_async.moe.routing`)."""
        prompt = input_ids.tolist() if isinstance(input_ids, np.ndarray) else [int(t) for t in input_ids]
        budget = int(sampling_params.get("max_new_tokens", 128))
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        routes: list[np.ndarray] = []
        done = 0
        resumed = 0
        start = routed_from
        while True:
            params = {**sampling_params, "max_new_tokens": budget - done}
            answer, server = await self._generate_once(prompt, params, episode, start)
            ids, lps, versions, finish, routed = answer
            parts.append((ids, lps, versions))
            if start is not None:
                if routed is None:
                    raise BadResponse("no meta_info.routed_experts although asked for (SGLang needs "
                                      "--enable-return-routed-experts)")
                routes.append(routed)
            done += len(ids)
            # The server aborted it by itself (a weight update in abort mode): resume with the partial
            # output under the new weights, unless nothing is left to generate.
            if finish == "abort" and done < budget and resumed < self.max_resumes:
                resumed += 1
                self.stats.resumes += 1
                if start is not None:  # the part's last token was never fed: its routing comes next
                    start = len(prompt) + len(ids) - 1 if len(prompt) + len(ids) else 0
                prompt = prompt + ids.tolist()
                continue
            if len(parts) > 1:
                ids, lps, versions = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
            record = None if start is None else (routes[0] if len(routes) == 1 else np.concatenate(routes))
            return ServerReply(ids, lps, versions, finish, server, resumed, record)

    async def _generate_once(
        self, input_ids: list[int], sampling_params: dict[str, Any], episode: str | None,
        routed_from: int | None = None,
    ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray | None], str]:
        return await self._with_failover(
            self.GENERATE, lambda rid: self._body(input_ids, sampling_params, rid, routed_from), self._parse,
            episode)

    async def _with_failover(self, route: str, body_of: Any, parse: Any, episode: str | None,
                             abortable: bool = True) -> tuple[Any, str]:
        """POST `body_of(rid)` to `route` on a healthy server and `parse` the answer, retrying with
        backoff and failing over to another server; a ServerError when every attempt failed."""
        assert self._session is not None, "call start() (or use `async with`) first"
        delay = self.backoff
        last_error = "no healthy server"
        tried: set[str] = set()
        for attempt in range(self.retries + 1):
            server = self._pick(episode, avoid=tried)
            if server is None:
                await asyncio.sleep(delay)  # every server is down: wait for the health checks
                delay = min(delay * 2, self.max_backoff)
                tried.clear()
                continue
            rid = f"{self._rid_prefix}{next(self._rid_count)}"
            body = body_of(rid)
            server.outstanding += 1
            start = time.monotonic()
            try:
                self.stats.requests += 1
                async with self._session.post(server.url + route, data=body, headers=_JSON,
                                              timeout=self._timeout) as resp:
                    if resp.status >= 500:
                        raise BadResponse(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    if resp.status >= 400:  # our request is wrong: retrying elsewhere will not help
                        raise ValueError(f"{server.url}{route} refused the request: "
                                         f"{(await resp.text())[:500]}")
                    raw = await resp.read()
                answer = parse(raw)
                server.failures = 0
                server.latencies.append(time.monotonic() - start)
                if len(server.latencies) > 1000:
                    del server.latencies[:500]
                return answer, server.url
            except asyncio.CancelledError:
                if abortable:
                    self._abort_soon(server, rid)
                raise
            except (TimeoutError, aiohttp.ClientError, BadResponse, ConnectionError) as exc:
                if isinstance(exc, asyncio.TimeoutError) and abortable:
                    self._abort_soon(server, rid)  # it may still be decoding: stop it
                last_error = f"{server.url}: {type(exc).__name__}: {exc}"
                self.stats.errors[type(exc).__name__] += 1
                self._failed(server)
                tried.add(server.url)
                if episode is not None and self._sticky.get(episode) == server.url:
                    del self._sticky[episode]  # fail the episode over, resending its tokens
                    self.stats.failovers += 1
                if attempt < self.retries:
                    self.stats.retries += 1
                    self._warn.warning(f"{server.url} {type(exc).__name__}", "%s failed (%s), retrying in %.2fs",
                                       route, last_error, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_backoff)
            finally:
                server.outstanding -= 1
        raise ServerError(f"{route} failed after {self.retries + 1} attempts; last: {last_error}")

    # --- prompt scoring -------------------------------------------------------------------

    @property
    def any_healthy(self) -> bool:
        """Whether some server is not marked down (a caller that must not wait can skip the request)."""
        return any(s.healthy for s in self.servers.values())

    async def score(self, sequences: list[np.ndarray], starts: list[int]) -> list[np.ndarray]:
        """Each sequence's token logprobs under the server's model, from position `starts[i]` on: entry
        j of the i-th result is log p(token starts[i] + j | the tokens before it). SGLang's prompt
        scoring, batched in one request: `input_ids` a list, `logprob_start_len` one per sequence,
        `max_new_tokens` 0, and each reply's `meta_info.input_token_logprobs` (its first entry, the
        token at `logprob_start_len`, comes as null: ask from one position earlier). Retried and
        failed over like `generate`; a prefill decodes nothing, so nothing is aborted on a timeout."""
        if len(sequences) != len(starts):
            raise ValueError(f"score: {len(sequences)} sequences but {len(starts)} starts")
        if not sequences:
            return []
        asked = [max(0, s - 1) for s in starts]
        body = _ENCODER.encode({
            "input_ids": [seq.tolist() for seq in sequences], "return_logprob": True, "logprob_start_len": asked,
            "sampling_params": {"max_new_tokens": 0}})

        def parse(raw: bytes) -> list[np.ndarray]:
            return _parse_scores(raw, sequences, starts, asked)

        answer, _ = await self._with_failover(self.GENERATE, lambda rid: body, parse, None, abortable=False)
        return answer

    # --- the engine's dialect (`VLLMClient` overrides these) ---------------------------------

    GENERATE = "/generate"
    """The token-in/token-out route."""
    ABORT = "/abort_request"
    VERSION = "/get_model_info"
    """GET: a JSON object whose `weight_version` is the engine's current version."""
    LOAD = "/v1/loads?include=core"
    """GET: the engine's requests running and waiting (`_parse_load` reads it). SGLang's older
    `/get_load` counts waiting requests as running too, logs a deprecation per call, and is gone in 0.5.23."""

    def _parse_load(self, raw: bytes) -> tuple[int, int, int | None]:
        """(running, waiting, batch slots or None) from SGLang's `/v1/loads`: `loads`, one object per
        data-parallel rank (`max_running_requests` is 0 or absent where a rank does not say)."""
        ranks = json.loads(raw)["loads"]
        slots = [int(r.get("max_running_requests") or 0) for r in ranks]
        return (sum(int(r["num_running_reqs"]) for r in ranks), sum(int(r["num_waiting_reqs"]) for r in ranks),
                sum(slots) if all(slots) else None)

    def _body(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
              routed_from: int | None = None) -> bytes:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True,
                                "rid": rid}
        if routed_from is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routed_from)
        return _ENCODER.encode(body)

    def _abort_body(self, rid: str) -> dict[str, Any]:
        return {"rid": rid}

    def _parse(self, raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray | None]:
        try:
            data = _DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            raise BadResponse(f"malformed /generate response ({exc})") from None
        except msgspec.DecodeError as exc:
            raise BadResponse(f"not JSON ({exc})") from None
        meta = data.meta_info
        n = len(data.output_ids)
        if len(meta.output_token_logprobs) != n:
            raise BadResponse(f"{n} output tokens but {len(meta.output_token_logprobs)} logprobs")
        try:
            ids = np.array(data.output_ids, TOKEN_DTYPE) if n else _EMPTY_IDS
        except OverflowError:
            raise BadResponse("output_ids: a token id outside int32") from None
        lps = np.fromiter((t[0] for t in meta.output_token_logprobs), LOGPROB_DTYPE, n)
        finish = str((meta.finish_reason or {}).get("type", ""))
        spans = meta.weight_versions
        if spans is None:
            if meta.weight_version is None:
                raise BadResponse("malformed /generate response (no weight_version nor weight_versions)")
            spans = [_Span(meta.weight_version, 0, n)]
        routed = None
        if meta.routed_experts is not None:
            try:
                routed = decode_sglang(meta.routed_experts, width=1)[:, 0]
            except ValueError as exc:
                raise BadResponse(str(exc)) from None
        return ids, lps, self._versions(spans, n), finish, routed

    def _versions(self, spans: list[Any], n: int) -> np.ndarray:
        """The version of each of `n` output tokens from the answer's spans (`version`, `start`, `end`)."""
        versions = np.zeros(n, VERSION_DTYPE)
        for span in spans:
            if not str(span.version).lstrip("-").isdigit():
                # a replacement engine reports a non-number (`pending`) until the trainer's push
                # brings it to the current version: its tokens are not used
                raise BadResponse(f"weight version {span.version!r} is not a number (the server was not "
                                  "brought up to date yet)")
            versions[span.start:span.end] = int(span.version)
        if n:
            self._saw_version(int(versions.max()))
        return versions

    def _saw_version(self, version: int) -> None:
        if version > self.latest_version:
            self.latest_version = version
            self._notify(version)

    def _notify(self, version: int) -> None:
        for callback in self._version_listeners:
            result = callback(version)
            if asyncio.iscoroutine(result):
                self._spawn(result)

    # --- routing and health -------------------------------------------------------------

    def _pick(self, episode: str | None, avoid: set[str]) -> Server | None:
        if episode is not None:
            url = self._sticky.get(episode)
            if url is not None and self.servers[url].healthy and url not in avoid:
                return self.servers[url]
        candidates = [s for s in self.servers.values() if s.healthy and s.url not in avoid]
        if not candidates:
            return None
        server = min(candidates, key=lambda s: s.outstanding)
        if episode is not None:
            self._sticky[episode] = server.url
        return server

    def _failed(self, server: Server) -> None:
        server.failures += 1
        if server.failures >= self.unhealthy_after and server.healthy:
            server.healthy = False
            log.warning("server %s marked unhealthy after %d failures", server.url, server.failures)

    def _abort_soon(self, server: Server, rid: str) -> None:
        """Best effort, in the background: a cancelled or timed-out request must stop decoding."""
        session = self._session

        async def abort() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                assert session is not None
                async with session.post(server.url + self.ABORT, json=self._abort_body(rid), headers=self._admin,
                                        timeout=aiohttp.ClientTimeout(total=5)):
                    self.stats.aborts_sent += 1

        if session is not None and not session.closed:
            self._spawn(abort())

    def _spawn(self, coro: Any) -> None:
        """Run `coro` in the background, keeping a reference until it ends (close() waits for it)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _health_loop(self) -> None:
        assert self._session is not None
        while True:
            await asyncio.sleep(self.health_interval)
            for server in self.servers.values():
                if server.healthy:
                    continue
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                    async with self._session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            server.healthy, server.failures = True, 0
                            log.info("server %s is healthy again", server.url)

    async def refresh_version(self) -> int:
        """Ask every healthy server for its weight version (`/get_model_info`); returns the newest.

        Answers to /generate carry the version too, but a scheduler whose admission is blocked sends
        none: this is how it learns that the trainer moved on. When every server answers a version
        older than the newest seen, the trainer restarted from an older checkpoint and brought the
        engines back: the listeners hear the older version (answers to /generate, which may come
        from an engine a publish has not reached yet, only ever move it forward).
        """
        assert self._session is not None
        answers = []
        for server in self.servers.values():
            if not server.healthy:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError,
                                     KeyError, TypeError):
                async with self._session.get(server.url + self.VERSION,
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    version = str((await r.json(content_type=None))["weight_version"])
                if version.lstrip("-").isdigit():  # a replacement engine says `pending` until it is brought up
                    answers.append(int(version))
        if answers and max(answers) < self.latest_version:
            log.warning("every engine went back from version %d to %d (the trainer restarted from a checkpoint)",
                        self.latest_version, max(answers))
            self.latest_version = max(answers)
            self._notify(self.latest_version)
        elif answers:
            self._saw_version(max(answers))
        return self.latest_version

    async def load(self) -> EngineLoad | None:
        """Requests running and waiting on every healthy engine, summed; None when none answered
        (an engine without the route: `rollout.adaptive_concurrency` then keeps its limit)."""
        assert self._session is not None
        running = waiting = answered = 0
        capacity: int | None = 0
        for server in self.servers.values():
            if not server.healthy:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError,
                                     KeyError, TypeError):
                async with self._session.get(server.url + self.LOAD, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    r.raise_for_status()
                    one_running, one_waiting, one_capacity = self._parse_load(await r.read())
                running, waiting, answered = running + one_running, waiting + one_waiting, answered + 1
                capacity = None if capacity is None or one_capacity is None else capacity + one_capacity
        return EngineLoad(running, waiting, answered, capacity) if answered else None

    async def check_health(self) -> dict[str, bool]:
        """Probe every server now; returns url -> healthy."""
        assert self._session is not None
        for server in self.servers.values():
            try:
                async with self._session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    server.healthy = r.status == 200
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                server.healthy = False
        return {u: s.healthy for u, s in self.servers.items()}


def _parse_scores(raw: bytes, sequences: list[np.ndarray], starts: list[int], asked: list[int]) -> list[np.ndarray]:
    """The logprobs of tokens `starts[i]..` of each sequence from a batched scoring answer; a
    BadResponse when the answer does not cover them token for token."""
    try:
        answers = _SCORE_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadResponse(f"malformed scoring response ({exc})") from None
    if len(answers) != len(sequences):
        raise BadResponse(f"{len(sequences)} sequences scored but {len(answers)} answers")
    out = []
    for i, (answer, seq, start, first) in enumerate(zip(answers, sequences, starts, asked, strict=True)):
        entries = answer.meta_info.input_token_logprobs
        if len(entries) != len(seq) - first:
            raise BadResponse(f"sequence {i}: {len(entries)} input_token_logprobs for {len(seq) - first} tokens "
                              f"from position {first}")
        wanted = entries[start - first:]
        ids = np.fromiter((e[1] for e in wanted), np.int64, len(wanted))
        if not np.array_equal(ids, seq[start:]):
            raise BadResponse(f"sequence {i}: input_token_logprobs name other tokens than were sent")
        if any(e[0] is None for e in wanted):
            raise BadResponse(f"sequence {i}: a null logprob after the first scored position")
        out.append(np.fromiter((e[0] for e in wanted), LOGPROB_DTYPE, len(wanted)))
    return out
