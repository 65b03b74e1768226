"""Remote rewards: an HTTP reward model or an LLM judge, called from an env's `@reward` or `@group_reward`.

Two protocols, one client (`RemoteReward`):
- `judge`: an LLM behind SGLang's `POST /generate` (a real SGLang server, or the embedded engine)
  reads `template` filled with the prompt, the reply and the label; the first group of
  `score_pattern` in its answer, divided by `max_score`, is the score.
- `reward_model`: `POST URL` with `[{"prompt", "response", "label"}, ...]` (up to `batch_size`
  items: concurrent calls are gathered into one request), answered by a JSON list of numbers, or
  of `{"reward": x}` objects (slime's remote RM answers one object per request: `batch_size: 1`
  sends the object itself, not a list).

Every call has a timeout and bounded retries with backoff, and at most `max_concurrency`
requests are in flight. A call that fails for good raises `RemoteRewardError` naming the URL and
what went wrong, so the `@reward`'s `on_error` value is used and `reward_errors` counted: an
unreachable server never stops a run. `stats` counts requests, retries, timeouts, HTTP errors and
unparseable answers.

In an env, share one client per rollout worker (environments are one instance per episode, the
HTTP session must not be): `shared_remote_reward(args)` gives the client of the running event loop.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import aiohttp
import msgspec

DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\nQuestion: {prompt}\nReference answer: {label}\n"
    "Response: {response}\nReply with 'Score: N'.\nScore:"
)


class RemoteRewardArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach and read a reward model or judge (an env's args may hold one)."""

    url: str
    """Base URL of the judge's SGLang API (`/generate` is appended), or the reward model's endpoint."""
    mode: Literal["judge", "reward_model"] = "judge"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Per HTTP request; past it the request is retried (and counted in `timeouts`)."""
    retries: Annotated[int, msgspec.Meta(ge=0)] = 2
    """Retries after the first attempt, on connection errors, timeouts, 5xx and 429."""
    backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    """First retry delay; doubled each retry."""
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16
    """Requests in flight at once, for this client."""
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    """`reward_model`: items per request (a JSON list); concurrent calls are gathered into batches."""
    template: str = DEFAULT_TEMPLATE
    """`judge`: the prompt, with `{prompt}`, `{response}` and `{label}`."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """`judge`: a regex whose first group (first match) is the score in the judge's answer."""
    max_score: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """`judge`: the score is divided by this (10 → a 0..1 reward)."""
    verdicts: dict[str, float] = {}
    """`judge`: verdict words and their scores (e.g. `{"CORRECT": 1, "WRONG": 0}`); when set, the
    verdict found first in the answer (case-insensitive) is the score, instead of `score_pattern`."""
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    headers: dict[str, str] = {}
    """Extra HTTP headers (e.g. an Authorization token)."""


class RemoteRewardError(RuntimeError):
    """The reward server failed for good (after retries) or answered something unreadable."""


class _Retryable(Exception):
    pass


@dataclass
class RemoteRewardStats:
    requests: int = 0
    retries: int = 0
    scored: int = 0
    failed: int = 0
    errors: Counter = field(default_factory=Counter)
    """By kind: timeout, connection, http_5xx, http_4xx, unparseable."""


@dataclass
class _Item:
    payload: dict[str, Any]
    future: asyncio.Future


class RemoteReward:
    """`async with RemoteReward(args) as rm: score = await rm.score(prompt, response, label)`."""

    def __init__(self, args: RemoteRewardArgs) -> None:
        self.args = args
        self.stats = RemoteRewardStats()
        self._pattern = re.compile(args.score_pattern)
        self._session: aiohttp.ClientSession | None = None
        self._gate = asyncio.Semaphore(args.max_concurrency)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._batcher: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    async def __aenter__(self) -> RemoteReward:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
        for task in self._sending:
            task.cancel()
        queued = []
        while not self._queue.empty():
            queued.append(self._queue.get_nowait())
        _fail(queued, RemoteRewardError(f"reward client for {self.args.url} closed"))
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.args.headers)
        return self._session

    async def score(self, prompt: Any, response: str, label: Any = None) -> float:
        """The score of one reply. Raises RemoteRewardError when it cannot be had."""
        payload = {"prompt": _text(prompt), "response": response, "label": label}
        try:
            if self.args.mode == "judge":
                value = await self._judge(payload)
            elif self.args.batch_size == 1:
                value = _reward_value((await self._post(self.args.url, payload)), self.args.url)
            else:
                value = await self._batched(payload)
        except RemoteRewardError:
            self.stats.failed += 1
            raise
        self.stats.scored += 1
        return value

    async def score_many(self, prompt: Any, responses: list[str], label: Any = None) -> list[float]:
        """Scores of several replies to one prompt (for `@group_reward`), concurrently."""
        return list(await asyncio.gather(*(self.score(prompt, r, label) for r in responses)))

    # ---- protocols ---------------------------------------------------------------------------

    async def _judge(self, payload: dict[str, Any]) -> float:
        text = self.args.template.format(prompt=payload["prompt"], response=payload["response"],
                                         label="" if payload["label"] is None else payload["label"])
        body = {"text": text, "sampling_params": {"temperature": self.args.temperature,
                                                  "max_new_tokens": self.args.max_new_tokens}}
        url = self.args.url.rstrip("/") + "/generate"
        answer = await self._post(url, body)
        reply = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(reply, str):
            self.stats.errors["unparseable"] += 1
            raise RemoteRewardError(f"judge {url}: answer has no 'text': {str(answer)[:200]}")
        value = self._read_score(reply)
        if value is None:
            self.stats.errors["unparseable"] += 1
            how = f"verdicts {sorted(self.args.verdicts)}" if self.args.verdicts else \
                f"score_pattern {self.args.score_pattern!r}"
            raise RemoteRewardError(f"judge {url}: no score in its reply {reply[:200]!r} ({how})")
        return value

    def _read_score(self, reply: str) -> float | None:
        """The judge's score in its reply, or None when there is none."""
        if self.args.verdicts:
            lower = reply.lower()
            found = [(lower.find(word.lower()), v) for word, v in self.args.verdicts.items() if word.lower() in lower]
            return float(min(found)[1]) if found else None
        m = self._pattern.search(reply)
        if m is None:
            return None
        try:
            return float(m.group(1) if m.groups() else m.group(0)) / self.args.max_score
        except ValueError:
            return None

    async def _batched(self, payload: dict[str, Any]) -> float:
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())
        item = _Item(payload, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(item)
        return await item.future

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # Whatever is already queued joins this request: no waiting for stragglers, so a lone
            # call is never delayed, and a burst of concurrent calls becomes few requests.
            while len(batch) < self.args.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            task = asyncio.create_task(self._send_batch(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_batch(self, batch: list[_Item]) -> None:
        try:
            answer = await self._post(self.args.url, [i.payload for i in batch])
            if not isinstance(answer, list) or len(answer) != len(batch):
                self.stats.errors["unparseable"] += 1
                raise RemoteRewardError(f"reward model {self.args.url}: expected a list of {len(batch)} scores, "
                                        f"got {str(answer)[:200]}")
            values = [_reward_value(a, self.args.url) for a in answer]
        except asyncio.CancelledError:
            _fail(batch, RemoteRewardError(f"reward client for {self.args.url} closed"))
            raise
        except Exception as exc:
            _fail(batch, exc if isinstance(exc, RemoteRewardError) else RemoteRewardError(str(exc)))
            return
        for i, v in zip(batch, values, strict=True):
            if not i.future.done():
                i.future.set_result(v)

    # ---- HTTP with retries -------------------------------------------------------------------

    async def _post(self, url: str, body: Any) -> Any:
        a = self.args
        last = ""
        for attempt in range(a.retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(a.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._gate:
                    self.stats.requests += 1
                    return await self._post_once(url, body)
            except _Retryable as exc:
                last = str(exc)
        raise RemoteRewardError(f"reward server {url} failed after {a.retries + 1} attempts: {last}")

    async def _post_once(self, url: str, body: Any) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.args.timeout_s)
        try:
            async with self.session.post(url, json=body, timeout=timeout) as resp:
                if resp.status >= 500 or resp.status == 429:
                    self.stats.errors["http_5xx" if resp.status >= 500 else "http_429"] += 1
                    raise _Retryable(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                if resp.status >= 400:
                    self.stats.errors["http_4xx"] += 1
                    raise RemoteRewardError(f"reward server {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                try:
                    return await resp.json(content_type=None)
                except ValueError as exc:
                    self.stats.errors["unparseable"] += 1
                    raise RemoteRewardError(f"reward server {url}: answer is not JSON: {exc}") from None
        except TimeoutError:
            self.stats.errors["timeout"] += 1
            raise _Retryable(f"timed out after {self.args.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            self.stats.errors["connection"] += 1
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None


def _fail(items: list[_Item], exc: Exception) -> None:
    for i in items:
        if not i.future.done():
            i.future.set_exception(exc)


def _text(prompt: Any) -> str:
    """A prompt for the judge's template: text as is, chat messages as 'role: content' lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        lines = []
        for m in prompt:
            role = getattr(m, "role", None) or (m.get("role") if isinstance(m, dict) else "")
            content = getattr(m, "content", None) or (m.get("content") if isinstance(m, dict) else "")
            lines.append(f"{role}: {content}")
        return "\n".join(lines)
    return str(prompt)


def _reward_value(answer: Any, url: str) -> float:
    if isinstance(answer, dict) and "reward" in answer:
        answer = answer["reward"]
    if isinstance(answer, bool) or not isinstance(answer, int | float):
        raise RemoteRewardError(f"reward model {url}: expected a number or {{'reward': number}}, "
                                f"got {str(answer)[:200]}")
    return float(answer)


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bytes, RemoteReward]] = (
    weakref.WeakKeyDictionary()
)


def shared_remote_reward(args: RemoteRewardArgs) -> RemoteReward:
    """The client for `args` on the running event loop (one HTTP session per worker, not per episode).
    Close them with `close_shared_remote_rewards()` before the loop ends."""
    clients = _SHARED.setdefault(asyncio.get_running_loop(), {})
    key = msgspec.json.encode(args)  # the args hold a dict (headers): not hashable themselves
    if key not in clients:
        clients[key] = RemoteReward(args)
    return clients[key]


async def close_shared_remote_rewards() -> None:
    """Close the running loop's shared clients (the rollout worker calls it at shutdown)."""
    for client in _SHARED.pop(asyncio.get_running_loop(), {}).values():
        await client.close()
