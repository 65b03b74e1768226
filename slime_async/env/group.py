"""Applying `@group_reward`s to a finished group (the scheduler calls it before sending the group)."""

from __future__ import annotations

import asyncio
import math

from slime_async.env.base import Env, EnvArgs
from slime_async.types import Trajectory


async def apply_group_rewards(env_cls: type[Env], trajectories: list[Trajectory], timeout_s: float = 30.0,
                              args: EnvArgs | None = None) -> None:
    """Add each group reward (weighted) to every trajectory's `rewards` and `reward`, in place.

    `args` are the env's arguments, for a group reward that takes `args` (default: `env_cls.Args()`).
    A group reward that raises, times out or returns the wrong number of values (or a non-finite
    one) gives every trajectory its `on_error` value, counts `reward_errors` in their metrics and
    keeps the message in their `errors`.
    """
    if not trajectories:
        return
    if args is None and any("args" in spec.params for spec in env_cls.group_rewards.values()):
        args = env_cls.Args()
    available = {"trajectories": trajectories, "task_id": trajectories[0].task_id, "args": args}
    for spec in env_cls.group_rewards.values():
        try:
            values = [float(v) for v in await asyncio.wait_for(spec.call(None, available), timeout_s)]
            if len(values) != len(trajectories):
                raise ValueError(f"returned {len(values)} values for {len(trajectories)} trajectories")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"returned {values}; expected finite numbers")
        except Exception as exc:
            values = [spec.on_error] * len(trajectories)
            what = f"{type(exc).__name__}: {exc}" if str(exc) else f"timed out after {timeout_s:g} s"
            for t in trajectories:
                t.metrics["reward_errors"] = t.metrics.get("reward_errors", 0.0) + 1
                t.metrics[f"reward_errors/{spec.name}"] = 1.0
                t.errors = {**t.errors, f"group_reward {spec.name}": what}
                t.error = t.error or f"group_reward {spec.name} failed: {what}"
        for t, v in zip(trajectories, values, strict=True):
            t.rewards[spec.name] = v
            t.reward += spec.weight * v
