"""Applying `@group_reward`s to a finished group (the scheduler calls it before sending the group)."""

from __future__ import annotations

import asyncio

from slime_async.env.base import Env
from slime_async.types import Trajectory


async def apply_group_rewards(env_cls: type[Env], trajectories: list[Trajectory], timeout_s: float = 30.0) -> None:
    """Add each group reward (weighted) to every trajectory's `rewards` and `reward`, in place.

    A group reward that raises, times out or returns the wrong number of values gives every
    trajectory its `on_error` value and counts `reward_errors` in their metrics.
    """
    if not trajectories:
        return
    available = {"trajectories": trajectories, "task_id": trajectories[0].task_id}
    for spec in env_cls.group_rewards.values():
        try:
            values = [float(v) for v in await asyncio.wait_for(spec.call(None, available), timeout_s)]
            if len(values) != len(trajectories):
                raise ValueError(f"returned {len(values)} values for {len(trajectories)} trajectories")
        except Exception as exc:
            values = [spec.on_error] * len(trajectories)
            for t in trajectories:
                t.metrics["reward_errors"] = t.metrics.get("reward_errors", 0.0) + 1
                t.metrics[f"reward_errors/{spec.name}"] = 1.0
                t.error = t.error or f"group_reward {spec.name} failed: {type(exc).__name__}: {exc}"
        for t, v in zip(trajectories, values, strict=True):
            t.rewards[spec.name] = v
            t.reward += spec.weight * v
