"""Sampling policies: which ready groups the trainer gets first.

A policy is a plain typed function: it receives the ready groups (oldest first) and the trainer's
version, and returns them in the order the trainer should get them. It may leave groups out (they
stay in the buffer for a later batch). The buffer then takes groups from the front until the batch
is full. Pass your own function as `Buffer(..., policy=my_policy)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from slime_async.types import Group

SamplingPolicy = Callable[[Sequence[Group], int], Sequence[Group]]
"""(ready groups oldest first, trainer version) -> the groups in the order to hand them out."""


def group_min_version(group: Group) -> int | None:
    """Oldest weight version among the group's generated tokens (None if it generated none)."""
    versions = [v for t in group.trajectories if (v := t.min_version()) is not None]
    return min(versions) if versions else None


def group_max_version(group: Group) -> int | None:
    """Newest weight version among the group's generated tokens (None if it generated none)."""
    versions = [int(turn.versions.max()) for t in group.trajectories for turn in t.turns if len(turn.versions)]
    return max(versions) if versions else None


def fifo(groups: Sequence[Group], trainer_version: int) -> Sequence[Group]:
    """Oldest ready group first: every group waits about as long as every other."""
    return groups


def freshest(groups: Sequence[Group], trainer_version: int) -> Sequence[Group]:
    """Groups made by the newest weights first (least off-policy); ties oldest first.

    Older groups may wait until they go stale and are dropped (counted): that is the trade this
    policy makes."""
    order = {id(g): i for i, g in enumerate(groups)}

    def key(g: Group) -> tuple[int, int]:
        v = group_min_version(g)
        return (-(v if v is not None else trainer_version), order[id(g)])

    return sorted(groups, key=key)


POLICIES: dict[str, SamplingPolicy] = {"fifo": fifo, "freshest": freshest}
"""The policies that the config can name (`buffer.policy`)."""
