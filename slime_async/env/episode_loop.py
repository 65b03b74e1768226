"""The turn loop of one episode (`_Episode`): render, call the model, parse, run tools, score.

`run_episode` (`env.episode`) runs it for an env that speaks the env API, and `env.driven` builds on
it for an env driven from outside (a black-box agent); both live apart from this module so that
neither imports the other's caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
import weakref
from typing import Any

import msgspec
import numpy as np

from slime_async.env.base import Env
from slime_async.env.limits import Limits
from slime_async.env.parsers import ToolCallParser
from slime_async.env.policy import Generation, Policy, Sampling
from slime_async.env.renderer import Renderer
from slime_async.env.rewards import RewardSpec
from slime_async.env.tools import ToolArgumentError, ToolError
from slime_async.moe.routing import record_turns
from slime_async.types import Message, StopReason, Task, ToolCall, Turn
from slime_async.types.arrays import TOKEN_DTYPE

# Counters every trajectory carries in `metrics` (0 when nothing happened), so that sums over a
# run are meaningful without knowing which episodes hit what.
COUNTERS = (
    "turns", "tool_calls", "tool_errors", "tool_timeouts", "unknown_tools", "bad_tool_args",
    "tool_outputs_truncated", "parse_errors", "reward_errors", "metric_errors", "teardown_errors", "new_branches",
    "completion_tokens", "total_tokens",
)  # fmt: skip


_STOP_WAITERS: weakref.WeakKeyDictionary[asyncio.Event, asyncio.Future[Any]] = weakref.WeakKeyDictionary()
"""One waiter per stop event, shared by every episode watching it: a waiter task per model call
cost each turn a task's creation and cancellation (about a tenth of a turn's CPU)."""


def _stop_waiter(stop: asyncio.Event) -> asyncio.Future[Any]:
    waiter = _STOP_WAITERS.get(stop)
    if waiter is None or waiter.cancelled() or (waiter.done() and not stop.is_set()):  # new, or a cleared event
        waiter = _STOP_WAITERS[stop] = asyncio.ensure_future(stop.wait())
    return waiter


class _Stop(Exception):
    """Ends the loop with a reason (internal)."""

    def __init__(self, reason: StopReason, error: str = "") -> None:
        self.reason, self.error = reason, error


class _Episode:
    def __init__(
        self, env: Env, task: Task, policy: Policy, tokenizer: Any, limits: Limits, sampling: Sampling,
        parser: ToolCallParser | None, stop: asyncio.Event | None,
    ) -> None:  # fmt: skip
        self.env, self.task, self.policy, self.limits, self.sampling = env, task, policy, limits, sampling
        self.tokenizer, self.parser, self.stop = tokenizer, parser, stop
        self.turns: list[Turn] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.reason = StopReason.ABORTED
        self.error = ""
        self.errors: dict[str, str] = {}
        """The first message of each reward, metric or tool that failed, by `kind name`."""
        self.rewards: dict[str, float] = {}
        self.reward = 0.0
        self.env_metrics: dict[str, float] = {}
        self.renderer: Renderer | None = None
        self.pending: list[int] = []  # environment tokens to record with the next model call
        self.branch = False  # whether `pending` starts a new branch (the whole context)
        self.t0 = time.monotonic()

    @property
    def metrics(self) -> dict[str, float]:
        out = {name: float(self.counts[name]) for name in COUNTERS}
        out.update({k: float(v) for k, v in self.counts.items() if k not in out})
        out.update(self.env_metrics)
        return out

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.limits.episode_timeout_s) as deadline:
                await self._setup()
                await self._loop()
        except _Stop as stop:
            self.reason, self.error = stop.reason, stop.error
        except TimeoutError:
            # Only the deadline's own expiry gets here: every other TimeoutError (a tool's, the
            # env's) is caught where it happens and becomes a message or an ENV_ERROR.
            if not deadline.expired():
                raise
            self.reason = StopReason.EPISODE_TIMEOUT
        self.timings["episode"] = time.monotonic() - self.t0
        if self.reason not in (StopReason.ENV_ERROR, StopReason.SERVER_ERROR, StopReason.ABORTED):
            t = time.monotonic()
            await self._score()
            self.timings["reward"] = time.monotonic() - t

    async def _setup(self) -> None:
        self.env.task = self.task
        try:
            await self.env.setup(self.task)
            messages = self.env.prompt(self.task)
            tools = self.env.tool_schemas() if self.env.show_tools else None
            self.renderer = Renderer(self.tokenizer, tools=tools, parser=self.parser)
            self.pending = self.renderer.start(messages)
            self.branch = False
        except Exception as exc:  # not CancelledError: a deadline or the caller is not the env's fault
            raise _Stop(StopReason.ENV_ERROR, f"setup failed: {type(exc).__name__}: {exc}") from exc

    async def _loop(self) -> None:
        renderer = self.renderer
        assert renderer is not None
        self.consecutive_parse_errors = 0
        for turn_index in range(self.limits.max_turns):
            if self.limits.max_total_tokens - len(renderer.ids) <= 0:
                raise _Stop(StopReason.MAX_TOKENS)
            try:
                async with asyncio.timeout(self.limits.turn_timeout_s) as turn_deadline:
                    new_messages = await self._turn()
                    if turn_index + 1 == self.limits.max_turns:
                        break
                    try:
                        delta = renderer.extend(new_messages)
                    except Exception as exc:  # the chat template refused the env's messages
                        raise _Stop(StopReason.ENV_ERROR, f"rendering failed: {type(exc).__name__}: {exc}") from exc
            except TimeoutError:
                if not turn_deadline.expired():
                    raise
                raise _Stop(StopReason.TURN_TIMEOUT) from None
            self.counts["new_branches"] += delta.new_branch
            self.pending, self.branch = delta.ids, delta.new_branch
            self.counts["total_tokens"] = len(renderer.ids)
        raise _Stop(StopReason.MAX_TURNS)

    async def _turn(self) -> list[Message]:
        """One model call and what answers it; raises _Stop when the episode ends here."""
        renderer, limits = self.renderer, self.limits
        assert renderer is not None
        sampling = self.sampling
        left = limits.max_total_tokens - len(renderer.ids)
        if left < sampling.max_new_tokens:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=left)
        gen = await self._generate(sampling)
        ids = gen.completion_ids
        completion = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        turn = Turn(
            prompt_ids=np.array(self.pending, TOKEN_DTYPE),
            completion_ids=ids if isinstance(ids, np.ndarray) and ids.dtype == TOKEN_DTYPE else completion,
            logprobs=gen.logprobs,
            versions=gen.versions, finish_reason=gen.finish_reason, new_branch=self.branch,
        )  # fmt: skip
        self.turns.append(turn)
        if gen.routed_experts is not None:
            record_turns(self.turns, gen.routed_experts)
        self.counts["turns"] += 1
        self.counts["completion_tokens"] += len(completion)
        if gen.finish_reason == "abort":
            raise _Stop(StopReason.ABORTED, "the server aborted the request")
        try:
            parsed = renderer.parse(completion)
        except Exception as exc:  # ids the tokenizer cannot decode: the server's fault
            raise _Stop(StopReason.SERVER_ERROR, f"undecodable output: {type(exc).__name__}: {exc}") from exc
        message = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
        renderer.add_completion(completion, message)
        self.counts["total_tokens"] = len(renderer.ids)
        if gen.finish_reason == "length":
            budget_hit = sampling.max_new_tokens < self.sampling.max_new_tokens
            raise _Stop(StopReason.MAX_TOKENS if budget_hit else StopReason.TRUNCATED)
        new_messages: list[Message] = []
        if parsed.errors:
            self.consecutive_parse_errors += 1
            self.counts["parse_errors"] += 1
            policy = limits.parse_errors
            if policy.mask_bad_turn:
                turn.loss_mask[:] = 0
            if not policy.feedback or self.consecutive_parse_errors >= policy.max_consecutive:
                raise _Stop(StopReason.PARSE_ERROR, "; ".join(parsed.errors))
            new_messages += [Message(role="tool", content=f"error: {e}", name="parse_error") for e in parsed.errors]
        else:
            self.consecutive_parse_errors = 0
        if parsed.tool_calls:
            if self.counts["tool_calls"] + len(parsed.tool_calls) > limits.max_tool_calls:
                raise _Stop(StopReason.MAX_TOOL_CALLS)
            new_messages += await self._run_tools(parsed.tool_calls)
        elif not parsed.errors:
            reply = await self._on_reply(message)
            if not reply:
                raise _Stop(StopReason.DONE)
            new_messages += reply
        if self.env.done:
            raise _Stop(StopReason.DONE)
        return new_messages

    async def _generate(self, sampling: Sampling) -> Generation:
        assert self.renderer is not None
        stop, task = self.stop, asyncio.current_task()
        if stop is not None and stop.is_set():
            raise _Stop(StopReason.ABORTED, "stopped by the caller")
        # The call runs in this task, not a task of its own with an asyncio.wait beside it (that
        # cost a turn ~15 us): a stop while it runs cancels this task, and the CancelledError that
        # comes out of the call is turned into the stop here. `waiting` keeps a stop that arrives
        # after the call from cancelling anything else.
        waiting, stopped = True, False

        def on_stop(_: asyncio.Future[Any]) -> None:
            nonlocal stopped
            if waiting and task is not None:
                stopped = True
                task.cancel()

        # The waiter is shared by every episode watching `stop`: never cancelled here.
        waiter = _stop_waiter(stop) if stop is not None and task is not None else None
        if waiter is not None:
            waiter.add_done_callback(on_stop)
        cancelling = task.cancelling() if task is not None else 0
        t = time.monotonic()
        try:
            gen = await self.policy.generate(np.array(self.renderer.ids, dtype=np.int64), sampling)
        except asyncio.CancelledError:
            if not stopped or task is None or task.uncancel() > cancelling:
                raise  # the caller's cancellation (or a deadline's), also when a stop came with it
            raise _Stop(StopReason.ABORTED, "stopped by the caller") from None
        except Exception as exc:
            raise _Stop(StopReason.SERVER_ERROR, f"{type(exc).__name__}: {exc}") from None
        finally:
            waiting = False
            if waiter is not None:
                waiter.remove_done_callback(on_stop)
            self.timings["generate"] += time.monotonic() - t
        if stopped and task is not None:  # the call swallowed the stop's cancellation: still a stop
            task.uncancel()
            raise _Stop(StopReason.ABORTED, "stopped by the caller")
        n = len(gen.completion_ids)
        if len(gen.logprobs) != n or len(gen.versions) != n:
            raise _Stop(
                StopReason.SERVER_ERROR,
                f"malformed generation: {n} tokens, {len(gen.logprobs)} logprobs, {len(gen.versions)} versions",
            )
        return gen

    async def _on_reply(self, message: Message) -> list[Message] | None:
        try:
            return await self.env.on_reply(message)
        except Exception as exc:
            raise _Stop(StopReason.ENV_ERROR, f"on_reply failed: {type(exc).__name__}: {exc}") from exc

    # ---- tools -------------------------------------------------------------------------------

    async def _run_tools(self, calls: list[ToolCall]) -> list[Message]:
        t = time.monotonic()
        self.counts["tool_calls"] += len(calls)
        gate = asyncio.Semaphore(self.limits.max_parallel_tools)

        async def one(call: ToolCall) -> Message:
            async with gate:
                content = await self._call_tool(call)
            if len(content) > self.limits.max_tool_output_chars:
                self.counts["tool_outputs_truncated"] += 1
                cut = len(content) - self.limits.max_tool_output_chars
                content = content[: self.limits.max_tool_output_chars] + f"\n[... {cut} more characters cut]"
            return Message(role="tool", content=content, tool_call_id=call.id, name=call.name)

        try:
            if len(calls) == 1:  # the common case: no gather task
                return [await one(calls[0])]
            return list(await asyncio.gather(*(one(c) for c in calls)))
        finally:
            self.timings["tools"] += time.monotonic() - t

    async def _call_tool(self, call: ToolCall) -> str:
        spec = self.env.tools.get(call.name)
        if spec is None:
            self.counts["unknown_tools"] += 1
            return f"error: unknown tool {call.name!r}; the tools are: {', '.join(self.env.tools) or 'none'}"
        try:
            args = spec.validate(call.arguments)
        except ToolArgumentError as exc:
            self.counts["bad_tool_args"] += 1
            return f"error: bad arguments for {call.name}: {exc}"
        try:
            injected = {name: self.env.injected(name) for name in spec.hidden}
            async with asyncio.timeout(self.limits.tool_timeout_s) as deadline:
                result = await spec.invoke(self.env, args, injected)
        except TimeoutError:
            if not deadline.expired():
                return self._tool_failed(call.name, f"error: {call.name} raised TimeoutError")
            self.counts["tool_timeouts"] += 1
            return f"error: {call.name} timed out after {self.limits.tool_timeout_s:g} s"
        except ToolError as exc:
            return self._tool_failed(call.name, f"error: {exc}")
        except Exception as exc:
            return self._tool_failed(call.name, f"error: {call.name} raised {type(exc).__name__}: {exc}")
        if isinstance(result, str):
            return result
        try:
            return msgspec.json.encode(result).decode()
        except (TypeError, msgspec.EncodeError):
            return str(result)

    def _tool_failed(self, name: str, message: str) -> str:
        """Count a tool's failure under its name (the run's error counts show which tool fails, and how
        first); the message goes to the model, which may recover from it."""
        self.counts["tool_errors"] += 1
        self.counts[f"tool_errors/{name}"] += 1
        self.errors.setdefault(f"tool {name}", message.removeprefix("error: "))
        return message

    # ---- rewards and teardown ----------------------------------------------------------------

    async def _score(self) -> None:
        renderer = self.renderer
        messages = renderer.messages if renderer is not None else []
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        available = {
            "task": self.task, "answer": self.task.answer, "messages": messages,
            "completion": last.content if last is not None else "", "stop_reason": self.reason,
            "turns": self.turns, "metrics": self.metrics,
        }  # fmt: skip
        env = self.env
        for spec in env.rewards.values():
            self.rewards[spec.name] = await self._measure(spec, available)
        for spec in env.metrics.values():
            value = await self._measure(spec, available)
            if math.isfinite(value):  # a failed metric's NaN would make the buffer refuse the trajectory
                self.env_metrics[spec.name] = value
        penalty = self.limits.parse_errors.penalty
        if penalty and self.counts["parse_errors"]:
            self.rewards["parse_error"] = penalty * self.counts["parse_errors"]
        self.reward = sum(
            env.rewards[name].weight * value if name in env.rewards else value for name, value in self.rewards.items()
        )

    async def _measure(self, spec: RewardSpec, available: dict[str, Any]) -> float:
        try:
            if spec.inline:  # no task for a timeout that cannot fire: it runs to the end on the loop
                value = await spec.call(self.env, available)
            else:
                value = await asyncio.wait_for(spec.call(self.env, available), self.limits.reward_timeout_s)
            value = float(value)
            if not math.isfinite(value):  # the buffer refuses a non-finite value: an error here, by name
                raise ValueError(f"returned {value}; expected a finite number")
            return value
        except Exception as exc:  # raised or timed out; CancelledError still propagates
            counter = "metric_errors" if spec.kind == "metric" else "reward_errors"
            self.counts[counter] += 1
            self.counts[f"{counter}/{spec.name}"] += 1
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if isinstance(exc, TimeoutError) and not str(exc):  # wait_for's own: say which limit
                what = f"timed out after {self.limits.reward_timeout_s:g} s (limits.reward_timeout_s)"
            self.errors.setdefault(f"{spec.kind} {spec.name}", what)
            if not self.error and spec.kind != "metric":
                self.error = f"{spec.kind} {spec.name} failed: {what}"
            return spec.on_error

    async def teardown(self) -> None:
        if type(self.env).teardown is Env.teardown:
            return  # the base class's does nothing: no task to shield it
        # Shielded: a second cancellation while tearing down must not leak the env's resources.
        task = asyncio.ensure_future(asyncio.wait_for(self.env.teardown(), self.limits.teardown_timeout_s))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), self.limits.teardown_timeout_s)
            self._count_teardown(task)
            raise
        except Exception:
            pass
        self._count_teardown(task)

    def _count_teardown(self, task: asyncio.Future[Any]) -> None:
        if task.done() and not task.cancelled() and task.exception() is not None:
            self.counts["teardown_errors"] += 1
