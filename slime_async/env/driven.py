"""Episodes driven from outside: a black-box agent makes the model calls, the episode keeps the books.

An `Env` that overrides `drive(session)` hands its episode to code that does not speak the env API,
typically an agent program written against the OpenAI API (`slime_async.agents` serves it an
OpenAI-compatible endpoint). The agent asks for completions (`Session.complete`) as often as it
likes, with whatever messages it likes; each call's messages are checked against the conversation
the session holds:

- when they extend it (the held messages, including the reply the session gave, then new ones),
  only the new messages are rendered and tokenized, and the reply's tokens are kept exactly as the
  server generated them (token in, token out: no re-tokenization drift);
- otherwise (the agent dropped or edited a turn, changed its tools, or took a sample other than
  the last of an `n > 1` call) the call starts a new *segment*: the whole conversation rendered
  afresh, recorded as a turn with `new_branch=True` and counted in `metrics["new_branches"]`. The
  trainer trains each segment as a sequence of its own, with the episode's reward.

Every generated token keeps its logprob and weight version, as in `run_episode`, whose machinery
this reuses: the episode's limits end it with their StopReasons (the agent's next call is refused
with the reason), the caller's stop event aborts it, rewards and teardown run as for any env. What
the agent returns is its reward (`rewards["agent"]`), added to the env's own `@reward`s, if any.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
from typing import Any

import msgspec
import numpy as np

from slime_async.env.episode_loop import _Episode, _Stop, _stop_waiter
from slime_async.env.parsers import ParsedReply
from slime_async.env.policy import Generation, Sampling
from slime_async.env.renderer import Renderer
from slime_async.moe.routing import record_turns
from slime_async.types import Message, StopReason, Turn
from slime_async.types.arrays import TOKEN_DTYPE

GRACE_S = 2.0
"""How long an agent whose episode a limit ended may take to stop by itself before it is cancelled."""


class BadCall(ValueError):
    """The call's messages or tools cannot be rendered; the message names the place. Nothing was recorded."""


class EpisodeOver(RuntimeError):
    """The episode has ended (a limit, the caller's stop, a server failure): no more model calls."""

    def __init__(self, reason: StopReason, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"the episode is over ({reason.value}){': ' + detail if detail else ''}")


class Completion(msgspec.Struct, kw_only=True):
    """One sample of a model call, as the agent sees it and as it was recorded."""

    message: Message
    """The assistant message: text without tool-call blocks, and the parsed calls."""
    finish_reason: str
    """`stop`, `length` or `tool_calls` (OpenAI's names)."""
    completion_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    """Tokens of the context the sample continued."""
    parse_errors: list[str] = []
    """Malformed tool calls; the reply's text then holds them verbatim and no call is returned."""
    stop: str | None = None
    """The stop string that ended the reply (left out of `message.content`; the tokens keep it)."""


class DrivenEpisode(_Episode):
    """`run_episode`'s episode when the env drives itself (`Env.drive`); the env gets it as its
    session. Calls are taken one at a time, in arrival order."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.returned: float | None = None
        self.ended: asyncio.Future[_Stop] = asyncio.get_running_loop().create_future()
        self._lock = asyncio.Lock()
        self._clamped = False  # whether the last call's max_new_tokens was cut to the token budget

    # ---- the episode: the agent runs until it returns, fails or a limit ends it ---------------

    async def _setup(self) -> None:
        self.env.task = self.task
        try:
            await self.env.setup(self.task)
        except Exception as exc:
            raise _Stop(StopReason.ENV_ERROR, f"setup failed: {type(exc).__name__}: {exc}") from exc

    async def _loop(self) -> None:
        agent = asyncio.ensure_future(self.env.drive(self))
        watched: set[asyncio.Future[Any]] = {agent, self.ended}
        if self.stop is not None:
            watched.add(_stop_waiter(self.stop))
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if self.ended.done() and agent not in done:  # let the agent read its refusal and end by itself
                await asyncio.wait({agent}, timeout=GRACE_S)
        finally:
            if not agent.done():
                agent.cancel()
                # An agent in a thread cannot be stopped: its calls are refused from now on
                # (the session is closed), and the episode does not wait for it.
                with contextlib.suppress(BaseException):
                    await asyncio.wait({agent}, timeout=self.limits.teardown_timeout_s)
        if self.ended.done():  # a limit or a failure inside a call: its reason, whatever the agent did
            if agent.done() and not agent.cancelled():
                agent.exception()  # seen: most agents raise on their refusal
            raise self.ended.result()
        if agent not in done:  # the caller's stop event
            self._end(StopReason.ABORTED, "stopped by the caller")
            raise self.ended.result()
        if agent.cancelled():
            raise _Stop(StopReason.ENV_ERROR, "the agent was cancelled")
        exc = agent.exception()
        if exc is not None:
            raise _Stop(StopReason.ENV_ERROR, f"the agent raised {type(exc).__name__}: {exc}")
        returned = agent.result()
        if returned is not None:
            if not isinstance(returned, numbers.Real) or not math.isfinite(float(returned)):
                raise _Stop(StopReason.ENV_ERROR, f"the agent returned {returned!r}; expected a finite number or None")
            self.returned = float(returned)
        last = self.turns[-1] if self.turns else None
        if last is not None and last.finish_reason == "length":  # the reply the agent ended on was cut
            raise _Stop(StopReason.MAX_TOKENS if self._clamped else StopReason.TRUNCATED)
        raise _Stop(StopReason.DONE)

    async def _score(self) -> None:
        await super()._score()
        if self.returned is not None:
            self.rewards["agent"] = self.returned
            self.reward += self.returned

    def _end(self, reason: StopReason, error: str = "") -> EpisodeOver:
        if not self.ended.done():
            self.ended.set_result(_Stop(reason, error))
        stop = self.ended.result()
        return EpisodeOver(stop.reason, stop.error)

    # ---- the session: what the agent's model calls do ------------------------------------------

    @property
    def is_open(self) -> bool:
        return not self.ended.done()

    async def complete(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, sampling: Sampling | None = None,
        n: int = 1, parse_tools: bool = True, render_tools: bool = True,
    ) -> list[Completion]:  # fmt: skip
        """`n` samples continuing `messages`, recorded as turns of this episode.

        `tools` (OpenAI function schemas) go to the chat template when `render_tools`; replies are
        parsed for tool calls when `parse_tools`. `sampling` defaults to the episode's (its
        `max_new_tokens` is clamped to the episode's token budget). Raises BadCall for messages the
        template cannot render, EpisodeOver once the episode has ended (then and for every later call).
        """
        async with self._lock:
            if self.ended.done():
                raise self._end(StopReason.ABORTED)
            if self.counts["turns"] + n > self.limits.max_turns:
                raise self._end(StopReason.MAX_TURNS, f"at most {self.limits.max_turns} model calls")
            pending, branch = self._prompt(messages, tools if render_tools else None)
            renderer = self.renderer
            assert renderer is not None
            self.counts["new_branches"] += branch
            self.counts["total_tokens"] = len(renderer.ids)
            sampling = sampling or self.sampling
            left = self.limits.max_total_tokens - len(renderer.ids)
            if left <= 0:
                raise self._end(StopReason.MAX_TOKENS, f"the conversation has {len(renderer.ids)} tokens, the "
                                f"episode's budget is {self.limits.max_total_tokens}")
            self._clamped = left < sampling.max_new_tokens
            if self._clamped:
                sampling = msgspec.structs.replace(sampling, max_new_tokens=left)
            try:
                if n == 1:
                    gens = [await self._generate(sampling)]
                else:
                    gens = list(await asyncio.gather(*(self._generate(sampling) for _ in range(n))))
            except _Stop as stop:
                raise self._end(stop.reason, stop.error) from None
            return self._record(gens, pending, branch, sampling, parse_tools)

    def _prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> tuple[list[int], bool]:
        """The tokens this call appends, and whether they start a new segment (the whole context)."""
        if not messages:
            raise BadCall("messages: empty")
        if messages[-1].role == "assistant":
            raise BadCall(f"messages[{len(messages) - 1}]: the last message is the assistant's; continuing a "
                          "prefilled reply is not supported")
        held = self.renderer
        if (held is not None and held.tools == (tools or None) and held.messages
                and held.messages[-1].role == "assistant" and len(messages) > len(held.messages)
                and messages[: len(held.messages)] == held.messages):
            try:
                delta = held.extend(messages[len(held.messages):])
            except Exception as exc:
                raise BadCall(f"messages: the chat template refused them: {type(exc).__name__}: {exc}") from None
            return delta.ids, delta.new_branch
        try:
            renderer = Renderer(self.tokenizer, tools=tools, parser=self.parser)
            ids = renderer.start(messages)
        except Exception as exc:
            raise BadCall(f"messages: the chat template refused them: {type(exc).__name__}: {exc}") from None
        self.renderer = renderer
        return ids, bool(self.turns)

    def _record(self, gens: list[Generation], pending: list[int], branch: bool, sampling: Sampling,
                parse_tools: bool) -> list[Completion]:
        base = self.renderer
        assert base is not None
        context = len(base.ids)
        out = []
        for i, gen in enumerate(gens):
            # Sample 0 continues the held conversation; each further one is a segment of its own
            # (the same context, whole), and the last one recorded is what the session holds next.
            renderer = base if i == 0 else base.fork()
            ids = [int(t) for t in gen.completion_ids]
            self.turns.append(Turn(
                prompt_ids=np.array(pending if i == 0 else base.ids[:context], TOKEN_DTYPE),
                completion_ids=ids, logprobs=gen.logprobs, versions=gen.versions,
                finish_reason=gen.finish_reason, new_branch=branch if i == 0 else True,
            ))  # fmt: skip
            if gen.routed_experts is not None:  # an MoE model's routing replay
                record_turns(self.turns, gen.routed_experts)
            self.counts["turns"] += 1
            self.counts["completion_tokens"] += len(ids)
            self.counts["new_branches"] += i > 0
            if gen.finish_reason == "abort":
                raise self._end(StopReason.ABORTED, "the server aborted the request")
            try:
                parsed = renderer.parse(ids) if parse_tools else ParsedReply(content=renderer.text(ids))
            except Exception as exc:
                raise self._end(StopReason.SERVER_ERROR, f"undecodable output: {type(exc).__name__}: {exc}") from None
            content = parsed.content
            if parsed.errors:  # the text as it is, so that the agent sees what the model wrote
                self.counts["parse_errors"] += 1
                content = renderer.text(ids)
            matched = None
            if gen.finish_reason == "stop" and not parsed.tool_calls:
                content, matched = _trim_stop(content, sampling.stop)
            calls = [] if parsed.errors else parsed.tool_calls
            message = Message(role="assistant", content=content, tool_calls=calls)
            renderer.add_completion(ids, message)
            if i == len(gens) - 1:
                self.renderer = renderer
            self.counts["tool_calls"] += len(calls)
            finish = "length" if gen.finish_reason == "length" else "tool_calls" if calls else "stop"
            out.append(Completion(message=message, finish_reason=finish, completion_ids=ids,
                                  logprobs=[float(x) for x in gen.logprobs], prompt_tokens=context,
                                  parse_errors=list(parsed.errors), stop=matched))
        self.counts["total_tokens"] = len(self.renderer.ids) if self.renderer is not None else 0
        if self.counts["tool_calls"] > self.limits.max_tool_calls:
            raise self._end(StopReason.MAX_TOOL_CALLS, f"at most {self.limits.max_tool_calls} tool calls")
        return out


def _trim_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text without the stop string that ended it (the APIs leave it out; the tokens keep it), and it."""
    for stop in stops:
        if stop and text.endswith(stop):
            return text[: -len(stop)], stop
    return text, None
