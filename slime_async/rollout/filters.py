"""Group filters: which finished groups go to the trainer. Pure functions, shared by the scheduler and
the cluster simulator (`slime_async.sim`), so that both drop the same groups."""

from __future__ import annotations

from collections.abc import Sequence


def equal_rewards(rewards: Sequence[float]) -> bool:
    """DAPO-style: a group of two or more whose rewards are all equal carries no GRPO signal."""
    return len(rewards) > 1 and len(set(rewards)) == 1
