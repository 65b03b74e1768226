"""The scheduler: many episodes on one event loop, groups of n, staleness admission, no lockstep.

Every episode is an asyncio task. A new one starts whenever the concurrency limit and the
staleness budget allow; nothing waits for the slowest episode of a batch. When all n samples of
a task are done, the group gets its group rewards, is filtered (DAPO-style: equal rewards carry
no signal) and goes to the sink. Every started episode ends in exactly one sink record or one
counted drop: `stats.balanced()` checks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from slime_async.env import EnvFactory, Generation, Limits, Sampling, VerifierPool, apply_group_rewards
from slime_async.moe.routing import SequenceRoutes
from slime_async.moe.shape import MoeShape
from slime_async.rollout.admission import StalenessBudget
from slime_async.rollout.client import BadResponse, SGLangClient
from slime_async.rollout.concurrency import AdaptiveLimit, ConcurrencyGate, adapt
from slime_async.rollout.errors import ErrorBook
from slime_async.rollout.filters import equal_rewards
from slime_async.rollout.guard import Guard, Verdict
from slime_async.rollout.sinks import Sink
from slime_async.types import StopReason, Task, Trajectory, new_id

log = logging.getLogger(__name__)


class HttpPolicy:
    """The env API's `Policy` over the SGLang client; one per episode (sticky routing key). With
    `routes` (an MoE model's routing replay) each call also asks for the experts it routed to."""

    def __init__(self, client: SGLangClient, episode: str, routes: SequenceRoutes | None = None) -> None:
        self.client = client
        self.episode = episode
        self.routes = routes

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        start = None if self.routes is None else self.routes.start_len(input_ids)
        gen = await self.client.generate(input_ids, sampling.to_sglang(), episode=self.episode, routed_from=start)
        record = None
        if self.routes is not None and start is not None and gen.routed_experts is not None:
            try:
                record = self.routes.add(input_ids, gen.output_ids, start, gen.routed_experts)
            except ValueError as exc:
                raise BadResponse(f"{gen.server}: {exc}") from None
        return Generation(completion_ids=gen.output_ids, logprobs=gen.logprobs, versions=gen.versions,
                          finish_reason=gen.finish_reason if gen.finish_reason in ("stop", "length", "abort")
                          else "stop", routed_experts=record)


@dataclass
class RolloutStats:
    """Counts of a scheduler run; `started == sent + dropped` once it is drained."""

    started: int = 0
    finished: int = 0
    sent: int = 0
    dropped: Counter = field(default_factory=Counter)
    groups_sent: int = 0
    groups_dropped: Counter = field(default_factory=Counter)
    turns: int = 0
    tokens: int = 0
    stop_reasons: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)
    """Versions between the oldest token of a trajectory and the version when it was sent."""
    rewards: list[float] = field(default_factory=list)
    filter_errors: int = 0
    """Groups `rollout.group_filter` raised on (dropped as `filter_error`)."""
    errors: ErrorBook = field(default_factory=ErrorBook)
    """Rewards, metrics, tools and env hooks that failed, by name, with the first message of each."""
    verdicts: list[Verdict] = field(default_factory=list)
    """What the guard found (a run that cannot learn), in order."""
    started_at: float = field(default_factory=time.monotonic)

    def balanced(self) -> bool:
        return self.started == self.sent + sum(self.dropped.values())

    def summary(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {
            "episodes": self.finished, "sent": self.sent, "dropped": dict(self.dropped),
            "groups_sent": self.groups_sent, "groups_dropped": dict(self.groups_dropped),
            "episodes_per_s": self.finished / elapsed, "turns_per_s": self.turns / elapsed,
            "tokens_per_s": self.tokens / elapsed, "stop_reasons": dict(self.stop_reasons),
            "staleness": dict(self.staleness),
            "mean_reward": float(np.mean(self.rewards)) if self.rewards else 0.0,
            "errors": self.errors.summary(), "guard": [v.as_dict() for v in self.verdicts],
        }


class EnvChooser(Protocol):
    """What the scheduler takes as its factory: an EnvFactory, or a router over several
    (`slime_async.data.EnvRouter`) that picks each task's own."""

    name: str

    def for_task(self, task: Task) -> EnvFactory: ...


class Scheduler:
    """Runs groups of episodes against SGLang servers, into a sink: of one environment, or of
    each task's own when `factory` is a router."""

    def __init__(
        self,
        factory: EnvChooser,
        tasks: Iterable[Task],
        client: SGLangClient,
        tokenizer: Any,
        sink: Sink,
        *,
        group_size: int = 8,
        batch_size: int = 64,
        max_staleness: int = 2,
        max_concurrency: int = 256,
        sampling: Sampling | None = None,
        limits: Limits | None = None,
        filter_equal_rewards: bool = True,
        version: int = 0,
        accepted: int = 0,
        verifiers: VerifierPool | None = None,
        recount: Callable[[], Awaitable[int]] | None = None,
        guard: Guard | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
        group_filter: Callable[[list[Trajectory]], Any] | None = None,
        replay: MoeShape | None = None,
        adaptive_concurrency: bool = False,
    ) -> None:
        self.factory = factory
        self._tasks: Iterator[Task] = iter(tasks)
        self.client = client
        self.tokenizer = tokenizer
        self.sink = sink
        self.group_size = group_size
        self.sampling = sampling or Sampling()
        self.limits = limits
        self.filter_equal_rewards = filter_equal_rewards
        self.verifiers = verifiers
        self.budget = StalenessBudget(batch_size, max_staleness, version=version, accepted=accepted)
        self.recount = recount
        """What this scheduler's share of the run has accepted, asked again when the engines go back
        to an older version (the buffer's count: a restarted trainer trains what it got back)."""
        self.guard = guard
        """Watches finished groups for a run that cannot learn; `on_verdict` hears what it finds (the
        caller stops: a rollout worker under the launcher must not exit on its own)."""
        self.on_verdict = on_verdict
        self.group_filter = group_filter
        """`rollout.group_filter`: True keeps a finished group, False or a reason drops it (`filtered`)."""
        self.replay = replay
        """An MoE model's shape when its routing is recorded for replay (`train.moe.routing_replay`)."""
        self.adaptive = AdaptiveLimit(floor=min(group_size, max_concurrency), ceiling=max_concurrency) \
            if adaptive_concurrency else None
        """`rollout.adaptive_concurrency`: the episodes in flight follow the engines' load, up to
        `max_concurrency` (`rollout/concurrency.py`); None: `max_concurrency` episodes."""
        self._slots = ConcurrencyGate(self.adaptive.limit if self.adaptive else max_concurrency)
        self.stats = RolloutStats()
        self._stop = asyncio.Event()
        client.on_version(self._on_version)

    def concurrency(self) -> dict[str, Any]:
        """Episodes in flight and their limit; with adaptive concurrency, the recent engine loads it followed."""
        out: dict[str, Any] = {"limit": self._slots.limit, "in_flight": self._slots.in_flight,
                               "adaptive": self.adaptive is not None}
        if self.adaptive is not None:
            out["recent"] = [{"running": r, "waiting": w, "limit": n} for r, w, n in self.adaptive.history[-16:]]
        return out

    async def _on_version(self, version: int) -> None:
        if version < self.budget.version and self.recount is not None:
            log.warning("the engines went back from version %d to %d: admission recounts what was accepted",
                        self.budget.version, version)
            await self.budget.recover(version, await self.recount())
        else:
            await self.budget.set_version(version)

    async def set_version(self, version: int) -> None:
        """Tell the scheduler the engines now serve `version` (from the weight-sync protocol)."""
        await self.budget.set_version(version)

    def stop(self) -> None:
        """Start no new groups; running episodes finish (as ABORTED at their next model call)."""
        self._stop.set()

    async def run(self, num_groups: int | None = None) -> RolloutStats:
        """Run until `num_groups` groups finished (or the tasks run out, or `stop()`); returns the stats."""
        groups: dict[asyncio.Task, asyncio.Future] = {}
        stopping = asyncio.ensure_future(self._stop.wait())
        watcher = asyncio.ensure_future(self._watch_version())
        sizer = asyncio.ensure_future(adapt(self._slots, self.adaptive, self.client.load)) \
            if self.adaptive is not None else None
        try:
            for count in itertools.count():
                if (num_groups is not None and count >= num_groups) or self._stop.is_set():
                    break
                task = next(self._tasks, None)
                if task is None:
                    break
                admitted: asyncio.Future = asyncio.get_running_loop().create_future()
                group = asyncio.create_task(self._run_group(task, admitted))
                groups[group] = admitted
                group.add_done_callback(lambda g: groups.pop(g, None))
                # Start the next group only once this one's episodes are all admitted: admission
                # order is then group order, and a full budget holds back whole groups.
                await asyncio.wait({admitted, group, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if self._stop.is_set():
                for group, admitted in list(groups.items()):
                    if not admitted.done():  # still waiting for admission: give up the rest of it
                        group.cancel()
            if groups:
                await asyncio.gather(*groups, return_exceptions=True)
        finally:
            stopping.cancel()
            watcher.cancel()
            if sizer is not None:
                sizer.cancel()
            for g in list(groups):
                g.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*groups, return_exceptions=True)
        return self.stats

    async def _watch_version(self, interval: float = 0.5, every: int = 10) -> None:
        """While admission is blocked, ask the engines for their version: with nothing in flight no
        answer would bring it, and the run would wait forever for a trainer that already moved on.
        Otherwise every `every` intervals: answers to /generate never say that the engines went
        back (a trainer restarted from a checkpoint), and admission must then wait for it."""
        for tick in itertools.count(1):
            await asyncio.sleep(interval)
            if not self.budget.can_start() or tick % every == 0:
                await self.client.refresh_version()

    async def _run_group(self, task: Task, admitted: asyncio.Future) -> None:
        group_id = new_id()
        episodes: list[asyncio.Task] = []
        # A router (several environments in one run) picks the task's own; a plain factory is itself.
        try:
            factory = self.factory.for_task(task)
        except ValueError as exc:  # a task naming an unknown environment costs that task, not the run
            log.error("task %s skipped: %s", task.id, exc)
            self.stats.groups_dropped["bad_task"] += 1
            admitted.set_result(None)
            return
        try:
            for i in range(self.group_size):
                await self.budget.acquire()
                await self._slots.acquire()
                self.stats.started += 1
                episodes.append(asyncio.create_task(self._run_one(factory, task, group_id, i)))
        except asyncio.CancelledError:
            # Stopped before the group was whole: its started episodes end (ABORTED at their next
            # model call) and are dropped, counted, so that nothing started goes unaccounted.
            for result in await asyncio.gather(*episodes, return_exceptions=True):
                await self.budget.release(kept=False)
                self.stats.finished += 1
                self.stats.dropped["aborted"] += 1
                if isinstance(result, Trajectory):
                    self.stats.stop_reasons[result.stop_reason.value] += 1
            raise
        finally:
            if not admitted.done():
                admitted.set_result(None)
        trajectories: list[Trajectory] = await asyncio.gather(*episodes)
        await self._finish_group(trajectories, factory)

    def _routes(self) -> SequenceRoutes | None:
        r = self.replay
        return None if r is None else SequenceRoutes(r.route_width, r.num_experts)

    async def _run_one(self, factory: EnvFactory, task: Task, group_id: str, index: int) -> Trajectory:
        episode = f"{group_id}-{index}"
        try:
            return await factory.episode(
                task, HttpPolicy(self.client, episode, self._routes()), self.tokenizer,
                limits=self.limits, sampling=self.sampling, stop=self._stop, group_id=group_id,
                sample_index=index, verifiers=self.verifiers,
            )
        finally:
            self._slots.release()
            self.client.release(episode)

    def _filtered(self, group: list[Trajectory]) -> str | None:
        """The drop reason `rollout.group_filter` gives this group, or None to keep it."""
        assert self.group_filter is not None
        try:
            verdict = self.group_filter(group)
            if not isinstance(verdict, bool | str):
                raise TypeError(f"returned {verdict!r}; expected True (keep), False or a reason (drop)")
        except Exception as exc:  # a failing filter drops the group: never send what it could not judge
            self.stats.filter_errors += 1
            if self.stats.filter_errors == 1:
                log.warning("rollout.group_filter failed (first time in this worker; such groups are dropped): "
                            "%s: %s", type(exc).__name__, exc)
            return "filter_error"
        if verdict is True:
            return None
        if isinstance(verdict, str) and self.stats.dropped["filtered"] == 0:
            log.info("rollout.group_filter dropped a group (first time in this worker): %s", verdict)
        return "filtered"

    async def _finish_group(self, group: list[Trajectory], factory: EnvFactory) -> None:
        s = self.stats
        for t in group:
            s.finished += 1
            s.stop_reasons[t.stop_reason.value] += 1
            s.turns += len(t.turns)
            s.tokens += t.num_completion_tokens
        reason = self._drop_reason(group)
        if reason is None:
            await apply_group_rewards(factory.cls, group, args=factory.args)
            if self.filter_equal_rewards and equal_rewards([t.reward for t in group]):
                reason = "equal_rewards"
            elif self.group_filter is not None:
                reason = self._filtered(group)
        kept = reason is None
        for t in group:
            s.rewards.append(t.reward)
            for key in s.errors.add(t):  # the first of each kind in the log; the counts in the stats
                log.warning("%s failed (first time in this worker): %s", key, s.errors.first[key])
            await self.budget.release(kept)
        verdict = self.guard.observe(group, reason in (None, "equal_rewards")) if self.guard else None
        if verdict is not None:
            s.verdicts.append(verdict)
            log.warning("rollout.guard (%s): %s; first error: %s", verdict.action, verdict.reason,
                        verdict.first_error or "-")
            if self.on_verdict is not None:
                self.on_verdict(verdict)
        if not kept:
            s.dropped[reason] += len(group)
            s.groups_dropped[reason] += 1
            return
        for t in group:
            s.staleness[t.staleness(self.budget.version)] += 1
        await self.sink.put(group)
        s.sent += len(group)
        s.groups_sent += 1

    @staticmethod
    def _drop_reason(group: list[Trajectory]) -> str | None:
        """A group with an episode that could not finish (server or env failure) is not trainable."""
        for t in group:
            if t.stop_reason in (StopReason.SERVER_ERROR, StopReason.ENV_ERROR, StopReason.ABORTED):
                return t.stop_reason.value
        return None
