"""Group filters: which finished groups go to the trainer. Pure functions, shared by the scheduler and
the cluster simulator (`slime_async.sim`), so that both drop the same groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def equal_rewards(rewards: Sequence[float]) -> bool:
    """DAPO-style: a group of two or more whose rewards are all equal carries no GRPO signal."""
    return len(rewards) > 1 and len(set(rewards)) == 1


def load_group_filter(rollout: Any) -> Callable[[list[Any]], Any] | None:
    """`rollout.group_filter`, imported (an EnvLoadError naming the setting when it cannot be)."""
    if rollout.group_filter is None:
        return None
    from slime_async.env.loading import import_named

    fn = import_named(rollout.group_filter, "rollout.group_filter", "my_filters:varied_enough", kind="function")
    if not callable(fn):
        from slime_async.env import EnvLoadError

        raise EnvLoadError(f"rollout.group_filter: {rollout.group_filter} is not a function")
    return fn
