"""`@reward`, `@metric` and `@group_reward`: verifiers declared on the Env class.

A reward or metric method receives only the arguments it names, from `REWARD_ARGS`; a name
outside that set is an error when the class is defined, not when the first episode ends.
Sync methods run in a thread (a verifier may be slow), unless declared `inline=True`: a check
that takes microseconds (a regex over the final reply) costs less than the thread hop (~100 us
of CPU, the biggest per-episode cost of a cheap env), so it runs on the event loop, with no
timeout. CPU-heavy or untrusted checks should go to `Env.verify` (a process pool). One that
raises or times out scores its `on_error` value and is counted in the trajectory's metrics
(`reward_errors`); it never ends the run.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
from collections.abc import Callable
from typing import Any

from slime_async.env.tools import DefinitionError

REWARD_ARGS = {
    "task": "the Task (its `answer` is the label)",
    "answer": "task.answer",
    "messages": "the whole conversation as list[Message]",
    "completion": "text content of the last assistant message ('' if none)",
    "stop_reason": "the episode's StopReason",
    "turns": "the episode's list[Turn] (tokens, logprobs, versions)",
    "metrics": "the episode's counters so far (tool_calls, tool_errors, ...)",
}
"""Argument names a `@reward` or `@metric` method may take (besides `self`)."""

GROUP_REWARD_ARGS = {
    "trajectories": "the group's list[Trajectory], rewards filled in",
    "task_id": "the group's task id",
    "args": "the env's validated arguments (`env.args`, an instance of the Env's `Args`)",
}
"""Argument names a `@group_reward` function may take."""


class RewardSpec:
    """A declared reward, metric or group reward."""

    def __init__(self, fn: Callable[..., Any], kind: str, weight: float, on_error: float, inline: bool = False) -> None:
        self.fn = fn
        self.kind = kind
        self.name = fn.__name__
        self.weight = weight
        self.on_error = on_error
        self.is_async = inspect.iscoroutinefunction(fn)
        if inline and self.is_async:
            raise DefinitionError(f"@{kind} {fn.__qualname__}: inline=True is for sync functions "
                            "(an async one runs on the loop anyway)")
        self.inline = inline
        """A sync function called on the event loop (no thread, no timeout): for microsecond checks only."""
        allowed = GROUP_REWARD_ARGS if kind == "group_reward" else REWARD_ARGS
        params = list(inspect.signature(fn).parameters)
        if kind != "group_reward":
            params = params[1:]  # self
        unknown = [p for p in params if p not in allowed]
        if unknown:
            close = {p: difflib.get_close_matches(p, allowed, n=1, cutoff=0.6) for p in unknown}
            hint = "".join(f"; did you mean {c[0]!r} for {p!r}?" for p, c in close.items() if c)
            raise DefinitionError(f"@{kind} {fn.__qualname__}: unknown argument(s) {unknown}{hint} "
                            f"(it may take {', '.join(allowed)})")
        self.params = params

    async def call(self, owner: Any, available: dict[str, Any]) -> Any:
        """Call with the arguments it names; a sync function runs in a thread unless it is inline."""
        kwargs = {p: available[p] for p in self.params}
        args = () if owner is None else (owner,)
        if self.inline:
            return self.fn(*args, **kwargs)
        if self.is_async:
            return await self.fn(*args, **kwargs)
        return await asyncio.to_thread(self.fn, *args, **kwargs)


def reward(
    fn: Callable[..., Any] | None = None, *, weight: float = 1.0, on_error: float = 0.0, inline: bool = False
) -> Any:
    """Declare a reward: `@reward` or `@reward(weight=0.5, on_error=0.0, inline=False)`. Returns a
    float (bool counts). `inline=True`: a sync check of microseconds, run on the loop (no thread)."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__slime_reward__ = RewardSpec(f, "reward", weight, on_error, inline)  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def metric(fn: Callable[..., Any] | None = None, *, on_error: float = float("nan"), inline: bool = False) -> Any:
    """Declare a metric: measured like a reward, recorded in `Trajectory.metrics`, never trained on
    (`inline` as for `reward`)."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__slime_reward__ = RewardSpec(f, "metric", 0.0, on_error, inline)  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def group_reward(fn: Callable[..., Any] | None = None, *, weight: float = 1.0, on_error: float = 0.0) -> Any:
    """Declare a reward over a finished group: a function (no `self`: it sees the group, not one
    episode) taking any of `trajectories`, `task_id` and `args` (the env's arguments), returning one
    float per trajectory. Applied by `apply_group_rewards`."""

    def mark(f: Callable[..., Any]) -> Any:
        f.__slime_reward__ = RewardSpec(f, "group_reward", weight, on_error)  # type: ignore[attr-defined]
        return staticmethod(f)

    return mark(fn) if fn is not None else mark
