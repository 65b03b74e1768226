"""`run_episode`: one environment, one task, one policy → one Trajectory.

Every ending is a StopReason (see `slime_async.types.StopReason`); bad model output and failing
tools become messages to the model and counters in `Trajectory.metrics`, never exceptions. What
leaves `run_episode` as an exception is the caller's doing: `asyncio.CancelledError` (it
cancelled the episode; `teardown` has run by then) or RuntimeError for an Env instance
reused. To withdraw an episode and still get its trajectory (StopReason.ABORTED), set the
`stop` event instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from slime_async.env.base import Env
from slime_async.env.driven import DrivenEpisode
from slime_async.env.episode_loop import _Episode
from slime_async.env.limits import Limits
from slime_async.env.parsers import ToolCallParser
from slime_async.env.policy import Policy, Sampling
from slime_async.env.verify import VerifierPool
from slime_async.types import Task, Trajectory


async def run_episode(
    env: Env,
    task: Task,
    policy: Policy,
    tokenizer: Any,
    *,
    limits: Limits | None = None,
    sampling: Sampling | None = None,
    parser: ToolCallParser | None = None,
    stop: asyncio.Event | None = None,
    group_id: str = "",
    sample_index: int = 0,
    env_name: str = "",
    verifiers: VerifierPool | None = None,
) -> Trajectory:
    """Run one episode of `env` (a fresh instance) on `task` with `policy`.

    `tokenizer` is the served model's HF tokenizer (its chat template renders the conversation).
    `limits` defaults to `env.limits`; `sampling` to `Sampling()` (its `max_new_tokens` is clamped
    to the episode's token budget). `stop`, when set, ends the episode with StopReason.ABORTED at
    its next model call (a running one is cancelled), with the turns so far and no rewards. The
    trajectory's `group_id` defaults to the task id. `verifiers` is the process pool that
    `Env.verify` uses (one per rollout worker).
    """
    if getattr(env, "_used", False):
        raise RuntimeError(f"{type(env).__name__} instance reused: make one instance per episode")
    env._used = True  # type: ignore[attr-defined]
    env.verifiers = verifiers
    kind = _Episode
    if type(env).drive is not Env.drive:  # an env driven from outside (a black-box agent)
        kind = DrivenEpisode
    episode = kind(env, task, policy, tokenizer, limits or env.limits, sampling or Sampling(), parser, stop)
    try:
        await episode.run()
    finally:
        await episode.teardown()
    return Trajectory(
        task_id=task.id,
        group_id=group_id or task.id,
        sample_index=sample_index,
        turns=episode.turns,
        stop_reason=episode.reason,
        rewards=episode.rewards,
        reward=episode.reward,
        metrics=episode.metrics,
        timings=dict(episode.timings),
        env=env_name or f"{type(env).__module__}:{type(env).__qualname__}",
        error=episode.error,
        errors=episode.errors,
    )
