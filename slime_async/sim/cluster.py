"""The discrete-event simulation of a whole run: engines, episodes, buffer, trainer, weight sync.

Simulated time replaces processes; everything that decides comes from the real code:
- admission: `rollout.admission.StalenessBudget` (AReaL's rule), one group admitted after another as
  the real `Scheduler.run` does, under its concurrency limit;
- the equal-rewards filter: `rollout.filters.equal_rewards`;
- the buffer: `buffer.core.Buffer` itself, fed real `Trajectory` values whose tokens carry the weight
  versions that made them (groups, stale eviction, the sampling policy, batches of whole groups);
- the trainer's consumption rule (`train.loop`): take a batch as soon as the buffer has one, train,
  publish the weights, report the version to the buffer;
- partial rollouts in place: a request running across an update goes on with the new weights, its
  oldest token keeping the old version; the scheduler learns a version from the next answer of an
  engine, or from its version poll while admission is blocked (`Scheduler._watch_version`, 0.5 s).
Only costs are modelled (`sim.costs`): decode under continuous batching, prefill, tool latency, the
trainer step, the publish and its pause, transport and the buffer's ingest.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from slime_async.buffer.core import Buffer
from slime_async.rollout.admission import StalenessBudget
from slime_async.rollout.filters import equal_rewards
from slime_async.sim.costs import DecodeCost, IngestCost, SyncCost, TrainerCost
from slime_async.sim.engines import Engine
from slime_async.sim.workload import EpisodeDraws, Workload
from slime_async.types import StopReason, Trajectory, Turn

_END, _TOOL, _INGEST, _TRAIN, _PUBLISH, _POLL, _PAUSE = range(7)


@dataclass(frozen=True)
class Cluster:
    """The machines and what their work costs."""

    num_engines: int
    decode: DecodeCost
    trainer: TrainerCost
    sync: SyncCost
    ingest: IngestCost
    cpu_share: float | None = None
    """Engines and trainer share the same CPUs (the 2-core machine): while both compute, each runs at
    this share of its own speed. None: separate devices."""
    colocated: bool = False
    """Engines and trainer share GPUs: engines generate nothing while the trainer trains and publishes."""

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"Cluster.num_engines must be >= 1, got {self.num_engines}")
        if self.cpu_share is not None and not 0 < self.cpu_share <= 1:
            raise ValueError(f"Cluster.cpu_share must be in (0, 1], got {self.cpu_share}")


@dataclass(frozen=True)
class Plan:
    """The RL settings that decide scheduling (the config's `rollout.*`, `buffer.policy`, `train.steps`)."""

    batch_size: int
    group_size: int
    max_staleness: int
    steps: int
    max_concurrency: int = 256
    policy: str = "fifo"
    filter_equal_rewards: bool = True
    version_poll_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("batch_size", "group_size", "steps", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"Plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"Plan.max_staleness must be >= 0, got {self.max_staleness}")


@dataclass
class SimResult:
    """What a simulated run did, in the terms of a real run's summary."""

    wall_s: float
    """Simulated seconds from the start to the end of the last step (a real run's last `elapsed_s`)."""
    step_end_s: list[float]
    max_staleness: int
    """The largest per-step staleness the trainer saw (a real run's `max_staleness`)."""
    train_staleness: Counter[int]
    """Per trained trajectory: trainer version at the step - its oldest token version."""
    sent_staleness: Counter[int]
    """Per kept trajectory at the moment its group was sent (the rollout worker's `staleness`)."""
    episodes: int
    filtered: int
    buffer: dict[str, int]
    utilisation: dict[str, float]
    trained_tokens: float
    events: int
    cpu_s: float
    """Real seconds the simulation took."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.step_end_s)

    def bottleneck(self) -> str:
        """The first resource that saturates; 'episode latency' when none does (the run waits on the
        slowest episodes within its staleness bound)."""
        u = self.utilisation
        if u["ingest"] >= 0.9:
            return "buffer ingest"
        if u["trainer"] + u["sync"] >= 0.9:
            return "weight sync" if u["sync"] > u["trainer"] else "trainer"
        if u["engines"] >= 0.9:
            return "engines"
        return "episode latency"

    def summary(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "steps": self.steps, "max_staleness": self.max_staleness,
                "train_staleness": dict(sorted(self.train_staleness.items())),
                "sent_staleness": dict(sorted(self.sent_staleness.items())), "episodes": self.episodes,
                "filtered": self.filtered, "buffer": self.buffer, "utilisation": self.utilisation,
                "bottleneck": self.bottleneck(), "trained_tokens": self.trained_tokens, "events": self.events,
                "cpu_s": self.cpu_s, **self.extra}


class _Group:
    __slots__ = ("admitted", "done", "episodes", "gid")

    def __init__(self, gid: str) -> None:
        self.gid = gid
        self.admitted = 0
        self.done = 0
        self.episodes: list[_Episode] = []


class _Episode:
    __slots__ = (
        "engine",
        "first_version",
        "group",
        "index",
        "last_version",
        "latencies",
        "reward",
        "tokens",
        "turn",
    )

    def __init__(self, group: _Group, index: int, tokens: list[float], latencies: list[float], reward: float):
        self.group = group
        self.index = index
        self.tokens = tokens
        self.latencies = latencies
        self.reward = reward
        self.turn = 0
        self.engine: Engine | None = None
        self.first_version: int | None = None
        self.last_version = 0


class Simulation:
    """One simulated run of `plan` on `cluster` with episodes drawn from `workload`."""

    def __init__(self, cluster: Cluster, plan: Plan, workload: Workload, seed: int = 0) -> None:
        self.c, self.p, self.w = cluster, plan, workload
        self.draws = EpisodeDraws(workload, np.random.default_rng(seed))
        rates = cluster.decode.per_request_rates()
        self.engines = [Engine(i, rates) for i in range(cluster.num_engines)]
        self.budget = StalenessBudget(plan.batch_size, plan.max_staleness)
        self.buffer = Buffer(plan.group_size, plan.max_staleness, policy=plan.policy)
        self.events: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._route: list[tuple[int, int]] = [(0, e.index) for e in self.engines]
        """Least-outstanding routing (the client's `_pick`) as a heap with stale entries skipped."""
        self.version = 0
        self.slots = 0
        self.group: _Group | None = None
        self.groups = 0
        self.episodes = 0
        self.filtered = 0
        self.sent_staleness: Counter[int] = Counter()
        self.train_staleness: Counter[int] = Counter()
        self.max_staleness = 0
        self.step_end: list[float] = []
        self._tokens: dict[str, float] = {}
        self._template = Trajectory(task_id="", group_id="", sample_index=0, turns=[], stop_reason=StopReason.DONE)
        self._turns: dict[tuple[int, int], Turn] = {}
        self._ids = 0
        self.ingest_free = 0.0
        self.ingest_busy = 0.0
        # trainer: idle (waiting for a batch), training or publishing
        self.trainer = "idle"
        self.batch_id = 0
        self.train_left = 0.0
        self.train_rate = 1.0
        self.train_last = 0.0
        self.train_gen = 0
        self.train_s = 0.0
        self.publish_s = 0.0
        self.trained_tokens = 0.0
        self.paused = False
        self.engines_running = 0
        self.batch_integral = 0.0
        self.poll_pending = False

    # -- plumbing -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, a, b))

    def _reschedule(self, e: Engine) -> None:
        e.generation += 1
        end = e.next_end()
        if end is not None:
            self._push(end, _END, e, e.generation)

    def _engine_speed(self) -> float:
        if self.paused:
            return 0.0
        active = self.trainer != "idle"
        if self.c.colocated and active:
            return 0.0
        if self.c.cpu_share is not None and active:
            return self.c.cpu_share
        return 1.0

    def _set_speeds(self, t: float) -> None:
        speed = self._engine_speed()
        for e in self.engines:
            if e.speed != speed:
                self._account(e, t)
                e.advance(t)
                e.speed = speed
                self._reschedule(e)

    def _account(self, e: Engine, t: float) -> None:
        """Time-integral of running requests over `max_batch`, for the engines' utilisation."""
        if e.heap and e.speed > 0:
            self.batch_integral += (t - e.last) * len(e.heap)

    def _running_changed(self, t: float, before: int, after: int) -> None:
        """Under shared CPUs the trainer slows while any engine computes."""
        if (before == 0) == (after == 0):
            return
        self.engines_running += 1 if after else -1
        if self.c.cpu_share is not None and self.trainer == "training":
            self._train_progress(t)
            self._train_schedule(t)

    # -- the trainer (its consumption rule is train.loop's) -------------------------------------
    def _train_progress(self, t: float) -> None:
        self.train_left -= (t - self.train_last) * self.train_rate
        self.train_last = t

    def _train_schedule(self, t: float) -> None:
        share = self.c.cpu_share
        self.train_rate = share if share is not None and self.engines_running else 1.0
        self.train_gen += 1
        self._push(t + max(self.train_left, 0.0) / self.train_rate, _TRAIN, self.train_gen)

    def _trainer_try(self, t: float) -> None:
        if self.trainer != "idle":
            return
        batch = self.buffer.get_batch(self.p.batch_size, self.batch_id)
        if batch is None:
            return
        tokens = 0.0
        oldest = self.version
        for g in batch.groups:
            for traj in g.trajectories:
                tokens += self._tokens.pop(traj.id)
                v = traj.min_version()
                if v is not None:
                    self.train_staleness[self.version - v] += 1
                    oldest = min(oldest, v)
        self.max_staleness = max(self.max_staleness, self.version - oldest)
        self.trained_tokens += tokens
        self.trainer = "training"
        self.train_left = self.c.trainer.step_s(tokens)
        self.train_s += self.train_left
        self.train_last = t
        self._train_schedule(t)
        self._set_speeds(t)

    def _train_done(self, t: float) -> None:
        self.trainer = "publishing"
        publish = self.c.sync.publish_s
        self.publish_s += publish
        pause = min(self.c.sync.pause_s, publish)
        if pause > 0:
            self._push(t + publish - pause, _PAUSE)
        self._push(t + publish, _PUBLISH)

    def _published(self, t: float) -> None:
        self.paused = False
        self.version += 1
        for e in self.engines:
            e.version = self.version
        self.buffer.set_version(self.version, trained=[self.batch_id], committed=self.version)
        self.batch_id += 1
        self.step_end.append(t)
        self.trainer = "idle"
        self._set_speeds(t)
        self._schedule_poll(t)
        self._trainer_try(t)

    # -- rollout: admission, episodes, groups ---------------------------------------------------
    def _schedule_poll(self, t: float) -> None:
        if not self.poll_pending and self.budget.version < self.version:
            self.poll_pending = True
            poll = self.p.version_poll_s
            self._push((math.floor(t / poll) + 1) * poll, _POLL)

    def _poll(self, t: float) -> None:
        self.poll_pending = False
        if self.budget.version >= self.version:
            return
        tick = round(t / self.p.version_poll_s)
        if not self.budget.can_start() or tick % 10 == 0:
            self.budget.version = self.version
            self._admit(t)
        else:
            self._schedule_poll(t)

    def _admit(self, t: float) -> None:
        n = self.p.group_size
        while self.slots < self.p.max_concurrency:
            g = self.group
            if g is None or g.admitted == n:
                g = self.group = _Group(f"g{self.groups}")
                self.groups += 1
            if not self.budget.try_start():
                return
            self.slots += 1
            g.admitted += 1
            tokens, latencies, reward = self.draws.next()
            ep = _Episode(g, g.admitted - 1, tokens, latencies, reward)
            g.episodes.append(ep)
            self.episodes += 1
            ep.engine = self._pick()
            self._submit(t, ep)

    def _pick(self) -> Engine:
        route = self._route
        while True:
            outstanding, i = route[0]
            if self.engines[i].outstanding == outstanding:
                return self.engines[i]
            heapq.heappop(route)  # an older count: the engine's current one has its own entry

    def _outstanding_changed(self, e: Engine) -> None:
        heapq.heappush(self._route, (e.outstanding, e.index))
        if len(self._route) > 4 * len(self.engines) + 64:
            self._route = [(x.outstanding, x.index) for x in self.engines]
            heapq.heapify(self._route)

    def _submit(self, t: float, ep: _Episode) -> None:
        e = ep.engine
        assert e is not None
        prompt = self.w.prompt_tokens if ep.turn == 0 else self.w.tool_response_tokens
        before = len(e.heap)
        self._account(e, t)
        if e.submit(t, ep.tokens[ep.turn] + prompt * self.c.decode.prefill_ratio, ep) and ep.first_version is None:
            ep.first_version = e.version
        self._running_changed(t, before, len(e.heap))
        self._outstanding_changed(e)
        self._reschedule(e)

    def _engine_end(self, t: float, e: Engine) -> None:
        before = len(e.heap)
        self._account(e, t)
        done, started = e.pop_finished(t)
        for ep in started:
            if ep.first_version is None:
                ep.first_version = e.version
        self._running_changed(t, before, len(e.heap))
        self._reschedule(e)
        if e.version > self.budget.version:  # the answer carries the engine's weight_version
            self.budget.version = e.version
        if done:
            self._outstanding_changed(e)
        for ep in done:
            ep.last_version = e.version
            ep.turn += 1
            if ep.turn < len(ep.tokens):
                self._push(t + ep.latencies[ep.turn - 1], _TOOL, ep)
            else:
                self._episode_done(t, ep)
        self._admit(t)

    def _episode_done(self, t: float, ep: _Episode) -> None:
        self.slots -= 1
        g = ep.group
        g.done += 1
        if g.done < self.p.group_size:
            return
        kept = not (self.p.filter_equal_rewards and equal_rewards([x.reward for x in g.episodes]))
        for _ in g.episodes:
            self.budget.finish(kept)
        if not kept:
            self.filtered += len(g.episodes)
            return
        trajs = []
        for x in g.episodes:
            first = x.first_version if x.first_version is not None else x.last_version
            self.sent_staleness[self.budget.version - first] += 1
            trajs.append(self._trajectory(g, x, first))
        start = max(t + self.c.ingest.latency_s, self.ingest_free)
        cost = len(trajs) * self.c.ingest.per_trajectory_s
        self.ingest_free = start + cost
        self.ingest_busy += cost
        self._push(self.ingest_free, _INGEST, trajs)

    def _trajectory(self, g: _Group, ep: _Episode, first: int) -> Trajectory:
        key = (first, ep.last_version)
        turn = self._turns.get(key)
        if turn is None:  # two tokens: the oldest and the newest version the episode generated with
            turn = self._turns[key] = Turn(prompt_ids=[], completion_ids=[0, 0], logprobs=[0.0, 0.0],
                                           versions=[first, ep.last_version])
        self._ids += 1
        tid = str(self._ids)
        self._tokens[tid] = (self.w.prompt_tokens + sum(ep.tokens)
                             + (len(ep.tokens) - 1) * self.w.tool_response_tokens)
        return msgspec.structs.replace(self._template, task_id=g.gid, group_id=g.gid, sample_index=ep.index,
                                       turns=[turn], reward=ep.reward, id=tid)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.process_time()
        self._admit(0.0)
        events = self.events
        n = 0
        t = 0.0
        while events and len(self.step_end) < self.p.steps:
            t, _, kind, a, b = heapq.heappop(events)
            n += 1
            if kind == _END:
                if b == a.generation:
                    self._engine_end(t, a)
            elif kind == _TOOL:
                self._submit(t, a)
            elif kind == _INGEST:
                for traj in a:
                    self.buffer.add(traj, now=t)
                self._trainer_try(t)
            elif kind == _TRAIN:
                if a == self.train_gen and self.trainer == "training":
                    self._train_done(t)
            elif kind == _PUBLISH:
                self._published(t)
            elif kind == _POLL:
                self._poll(t)
            elif kind == _PAUSE:
                self.paused = True
                self._set_speeds(t)
        if len(self.step_end) < self.p.steps:
            raise RuntimeError(f"simulation stalled at version {self.version} of {self.p.steps}: nothing left to "
                               f"happen (budget {self.budget.accepted}+{self.budget.running}, buffer "
                               f"{self.buffer.metrics()})")
        wall = self.step_end[-1]
        for e in self.engines:
            self._account(e, wall)
            e.advance(wall)
        max_batch = self.c.decode.max_batch * len(self.engines)
        return SimResult(
            wall_s=wall, step_end_s=self.step_end, max_staleness=self.max_staleness,
            train_staleness=self.train_staleness, sent_staleness=self.sent_staleness, episodes=self.episodes,
            filtered=self.filtered, buffer=self.buffer.metrics(), trained_tokens=self.trained_tokens, events=n,
            cpu_s=time.process_time() - started,
            utilisation={"engines": self.batch_integral / (wall * max_batch),
                         "engines_busy": sum(e.busy_s for e in self.engines) / (wall * len(self.engines)),
                         "trainer": self.train_s / wall, "sync": self.publish_s / wall,
                         "ingest": self.ingest_busy / wall},
        )


def simulate(cluster: Cluster, plan: Plan, workload: Workload, seed: int = 0) -> SimResult:
    """Run one simulation to `plan.steps` optimizer steps."""
    return Simulation(cluster, plan, workload, seed).run()
