"""The continuous training loop: take a batch as soon as one is ready, step, publish, repeat.

    batch = source.get_batch(B, timeout)          # no lockstep with rollout rounds
    prox  = recompute logprobs (or take behaviour)
    step (train.steps_per_batch optimizer steps)  # version += 1 per applied step
    publish weights as the new version to every engine; source.set_version(version)
    checkpoint when due

With several ranks (`train.world_size`), every rank runs this loop over its own backend; rank 0's
source and publisher are the real ones and the others' are stand-ins fed by rank 0 (`ranks`), and
each pass of the loop begins with a shared decision to go on or stop (`RankSync.decide`).

The version is the number of applied optimizer steps. It reaches the engines with the weights
(`weight_version`), where the rollout scheduler's admission control reads it, and the buffer through
`BatchSource.set_version` (its staleness filter). Blocking work (get_batch, forward/backward) runs in
a worker thread so that publishing and HTTP stay on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from slime_async.config.schema import TrainConfig
from slime_async.sync.publisher import NamedWeights, PublishReport
from slime_async.train.backend import TrainerBackend
from slime_async.train.batch import build_batch
from slime_async.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from slime_async.train.objective import Objective
from slime_async.types import Trajectory

log = logging.getLogger(__name__)


@runtime_checkable
class BatchSource(Protocol):
    """Where trajectories come from (the ZeroMQ buffer client implements this)."""

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        """Up to `n` trajectories (whole groups) ready for training, waiting at most `timeout`
        seconds; None (or []) when none became ready. Called from a worker thread."""
        ...

    def set_version(self, version: int) -> None:
        """The trainer's version is now `version` (staleness filtering uses it)."""
        ...

    def commit(self, version: int) -> None:
        """A checkpoint holds every step up to `version`: what they trained on is trained for good
        (before that, a trainer restarting from an older checkpoint gets it back)."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """A part whose state a checkpoint keeps (data offset, buffer WAL position): JSON-able dicts."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class WeightSink(Protocol):
    """What the loop needs from `sync.WeightPublisher`."""

    async def publish(self, weights: NamedWeights, version: int) -> PublishReport: ...

    async def reconcile(self, weights: NamedWeights, version: int) -> list[str]: ...

    async def release_memory(self) -> list[str]: ...

    async def restore_memory(self, weights: NamedWeights, version: int) -> PublishReport: ...

    async def close(self) -> None: ...


class RankSync(Protocol):
    """What the loop needs from the trainer ranks' control group (`ranks.ControlGroup`)."""

    rank: int

    @property
    def leader(self) -> bool: ...

    def decide(self, vote: int) -> int:
        """Collective: every rank's vote, the largest returned to all."""
        ...

    def agree(self, value: str | None) -> str | None:
        """Collective: rank 0's value on every rank."""
        ...

    def barrier(self) -> None: ...


class Stop(IntEnum):
    """A rank's vote at the top of each pass; the largest over the ranks is what all of them do."""

    GO = 0
    FINISHED = 1
    """`train.steps` or `train.time_limit_s` reached: a final checkpoint is written."""
    ASKED = 2
    """`stop()` (SIGTERM, SIGINT): end after the batch in progress, no final checkpoint."""


class PublishGaveUp(RuntimeError):
    """`sync.give_up_after` publishes in a row left engines behind."""


@dataclass
class StepRecord:
    """One batch's outcome, for logs and tests."""

    version: int
    """The trainer's version after this batch."""
    applied: int
    """Optimizer steps applied (skipped ones are in `skipped_steps`)."""
    trajectories: int
    loss: float
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    skipped_steps: list[str] = field(default_factory=list)
    max_staleness: int = 0
    """Version of the weights at the batch's last step minus the oldest token version in it
    (each step after the first on the same batch adds one)."""
    publish: PublishReport | None = None
    seconds: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    """Where `seconds` went: `wait_s` (for the batch), `batch_s` (building it), `recompute_s` (proximal
    and reference logprobs), `train_s` (the optimizer steps), `memory_s` (engines' memory released and
    taken back); the publish is `publish.seconds`. A run's time split (`bench e2e_gpu`) sums them."""


class Trainer:
    """The loop over a backend, a batch source and (optionally) a weight publisher."""

    def __init__(
        self,
        cfg: TrainConfig,
        backend: TrainerBackend,
        source: BatchSource,
        *,
        batch_size: int,
        temperature: float = 1.0,
        publisher: WeightSink | None = None,
        checkpoint_dir: Path | None = None,
        extra_state: dict[str, Stateful] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        release_memory: bool = False,
        ranks: RankSync | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"rollout.sampling.temperature: the trainer needs > 0 to compute logprobs, got "
                             f"{temperature}")
        self.cfg = cfg
        self.backend = backend
        self.source = source
        self.batch_size = batch_size
        self.temperature = temperature
        self.publisher = publisher
        self.checkpoint_dir = checkpoint_dir
        self.extra_state = extra_state or {}
        self.on_step = on_step
        self.release_memory = release_memory and publisher is not None
        """Engines give their GPU memory back while this trainer computes (they share its GPUs)."""
        self.ranks = ranks
        """The other trainer ranks (None: this is the only one)."""
        self.give_up_after = 0
        """`sync.give_up_after` (set by `build_trainer`)."""
        self._failed_publishes: dict[str, str] = {}
        self._failed_in_a_row = 0
        self.objective = Objective(cfg)
        self.version = 0
        self.counters: Counter[str] = Counter()
        """trajectories_trained, skipped:<reason> (trajectories; `step_not_applied` when the batch's step was
        skipped), truncated, masked_truncated and unmasked_truncated (`build_batch`), empty_batches,
        skipped_steps, publish_failures, engines_reconciled (engines found behind and brought up to date),
        checkpoints (saved, each followed by a commit to the source); and the env's failures in the
        trajectories it received, by name (`reward_errors/NAME`, `metric_errors/NAME`, `tool_errors/NAME`),
        so that metrics.jsonl and TensorBoard show a reward that raises (env errors end their group in the
        rollout, which counts them)."""
        self._stop = asyncio.Event()

    # --- resume -------------------------------------------------------------------------

    def resume(self, path: Path | None = None) -> bool:
        """Load `path` (or the latest checkpoint under `checkpoint_dir`); False when there is none."""
        if path is None:
            path = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
            if self.ranks is not None:  # rank 0's choice: a save in progress must not split the ranks
                agreed = self.ranks.agree(str(path) if path is not None else None)
                path = Path(agreed) if agreed is not None else None
            if path is None:
                return False
        state = load_checkpoint(path, self.backend, rank=self.ranks.rank if self.ranks else 0)
        self.version = int(state["version"])
        self.counters = Counter(state["trainer"].get("counters", {}))
        for name, part in self.extra_state.items():
            if name in state["extra"]:
                part.load_state_dict(state["extra"][name])
        self.source.set_version(self.version)
        log.info("resumed from %s at version %d", path, self.version)
        return True

    def save(self) -> Path:
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint directory configured")
        extra = {name: part.state_dict() for name, part in self.extra_state.items()}
        ranks = self.ranks
        return save_checkpoint(self.checkpoint_dir, self.version, self.backend,
                               {"counters": dict(self.counters)}, extra, keep=self.cfg.keep_checkpoints,
                               rank=ranks.rank if ranks else 0, barrier=ranks.barrier if ranks else None)

    # --- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask `run` to return after the batch in progress."""
        self._stop.set()

    async def run(self, until_version: int | None = None) -> None:
        """Train until the version reaches `until_version` (default `train.steps`) or `stop()`."""
        target = until_version if until_version is not None else self.cfg.steps
        limit = self.cfg.time_limit_s
        deadline = time.monotonic() + limit if limit is not None else math.inf
        if self.release_memory:
            # a trainer that died mid-step may have left the engines without their memory
            assert self.publisher is not None
            await self.publisher.restore_memory(self.backend.named_weights, self.version)
        elif self.publisher is not None:
            # engines that restarted or missed the last publish get this version before training goes on
            # (and every engine generates again: `WeightPublisher.reconcile`)
            behind = await self.publisher.reconcile(self.backend.named_weights, self.version)
            self.counters["engines_reconciled"] += len(behind)
        self.source.set_version(self.version)
        while True:
            vote = await self._decide(target, deadline)
            if vote == Stop.FINISHED and self.version < target:
                log.info("train.time_limit_s (%s s) reached at version %d", limit, self.version)
            if vote != Stop.GO:
                break
            record = await self.step(max_steps=target - self.version)
            if record is None:
                continue
            log.info("version %d: %d trajectories, loss %.4g, grad norm %.3g, clip %.3f, ess %.3f, "
                     "staleness <= %d, %.2fs", record.version, record.trajectories, record.loss, record.grad_norm,
                     record.metrics.get("clip_fraction", 0.0), record.metrics.get("ess", 1.0),
                     record.max_staleness, record.seconds)
            if self.on_step is not None:
                self.on_step(record)
            every = self.cfg.checkpoint_every
            if self.checkpoint_dir is None or not every:
                if record.applied:  # no checkpoint will hold it: a step counts as trained once applied
                    self.source.commit(self.version)
            elif record.applied and self.version % every == 0:
                await self._checkpoint()
        if self.checkpoint_dir is not None and vote != Stop.ASKED:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Save, then tell the source that what the steps so far trained on is trained for good."""
        await asyncio.to_thread(self.save)
        self.counters["checkpoints"] += 1
        self.source.commit(self.version)

    async def _decide(self, target: int, deadline: float) -> Stop:
        """This rank's vote, shared with the others: every rank stops after the same step."""
        if self._failed_in_a_row and self._failed_in_a_row >= self.give_up_after > 0 and (
                self.ranks is None or self.ranks.leader):  # rank 0 decides; the others hear it as an abort
            raise PublishGaveUp(f"sync.give_up_after={self.give_up_after}: {self._failed_in_a_row} publishes in a "
                                f"row left engines behind: {self._failed_publishes}")
        if self._stop.is_set():
            vote = Stop.ASKED
        elif self.version >= target or time.monotonic() >= deadline:
            vote = Stop.FINISHED
        else:
            vote = Stop.GO
        if self.ranks is not None:
            vote = Stop(await asyncio.to_thread(self.ranks.decide, int(vote)))
        return vote

    async def step(self, max_steps: int | None = None) -> StepRecord | None:
        """One batch: get it, train on it, publish. None when no batch came (or nothing in it trained)."""
        start = time.perf_counter()
        trajectories = await asyncio.to_thread(self.source.get_batch, self.batch_size, self.cfg.batch_timeout_s)
        got = time.perf_counter()
        if not trajectories:
            self.counters["empty_batches"] += 1
            if self.publisher is not None:  # idle: a good moment to catch up engines that fell behind
                behind = await self.publisher.reconcile(self.backend.named_weights, self.version)
                self.counters["engines_reconciled"] += len(behind)
            return None
        count_failures(self.counters, trajectories)
        built = build_batch(trajectories, self.cfg.max_seq_len, self.cfg.overlong,
                            vocab_size=getattr(self.backend, "vocab_size", None),
                            mask_truncated=self.cfg.mask_truncated,
                            route_width=getattr(self.backend, "route_width", None))
        for reason, n in built.skipped.items():
            self.counters[f"skipped:{reason}"] += n
        self.counters["truncated"] += built.truncated
        if built.masked:
            self.counters["masked_truncated"] += built.masked
        if built.unmasked:
            self.counters["unmasked_truncated"] += built.unmasked
        if built.unrouted:  # MoE replay asked for, but these rows' engines reported no routing
            self.counters["unrouted_rows"] += built.unrouted
        batch = built.batch
        if batch is None:
            self.counters["empty_batches"] += 1
            log.warning("batch of %d trajectories had nothing to train on: %s", len(trajectories),
                        dict(built.skipped))
            return None
        record = StepRecord(version=self.version, applied=0, trajectories=batch.num_trajectories, loss=0.0,
                            grad_norm=0.0)
        record.times = {"wait_s": got - start, "batch_s": time.perf_counter() - got}
        if self.release_memory:  # the engines share our GPUs: they give them up while we compute
            assert self.publisher is not None
            began = time.perf_counter()
            await self.publisher.release_memory()
            record.times["memory_s"] = time.perf_counter() - began
        try:
            await self._train(batch, record, max_steps)
        finally:
            if self.release_memory:  # back with this version's weights (also when the step failed)
                assert self.publisher is not None
                record.publish = await self.publisher.restore_memory(self.backend.named_weights, self.version)
        valid = batch.min_versions[batch.min_versions >= 0]
        oldest = int(valid.min()) if valid.numel() else self.version
        # the last step trained the weights of version (self.version - 1) on tokens as old as `oldest`
        record.max_staleness = max(0, self.version - (1 if record.applied else 0) - oldest)
        if record.applied:
            self.counters["trajectories_trained"] += batch.num_trajectories
        else:  # counted, never silently lost (docs/architecture.md, "Reliability rules")
            self.counters["skipped:step_not_applied"] += batch.num_trajectories
        if record.applied and self.publisher is not None and record.publish is None:
            record.publish = await self.publisher.publish(self.backend.named_weights, self.version)
        if record.publish is not None and record.publish.failed:
            self.counters["publish_failures"] += len(record.publish.failed)
            self._failed_in_a_row += 1
            self._failed_publishes = dict(record.publish.failed)
        elif record.publish is not None:
            self._failed_in_a_row = 0
        if record.applied:
            self.source.set_version(self.version)
        record.version = self.version
        record.seconds = time.perf_counter() - start
        return record

    async def _train(self, batch: Any, record: StepRecord, max_steps: int | None) -> None:
        """Proximal (and reference) logprobs, then up to `train.steps_per_batch` optimizer steps on `batch`."""
        obj = self.objective
        steps = self.cfg.steps_per_batch if max_steps is None else min(self.cfg.steps_per_batch, max_steps)
        began = time.perf_counter()
        prox: torch.Tensor | None
        if self.cfg.proximal == "behaviour":
            prox = batch.behaviour_logprobs
        elif steps == 1 and obj.can_fuse_proximal:
            prox = None  # the training forward's own logprobs, detached (objective.py says why that is exact)
        else:
            prox = (await asyncio.to_thread(self.backend.logprobs, batch, self.temperature)).logprobs
        ref = None
        if obj.needs_reference:
            ref = (await asyncio.to_thread(self.backend.logprobs, batch, self.temperature, False, True)).logprobs
        prep = obj.prepare(batch, prox, ref)
        record.times["recompute_s"] = time.perf_counter() - began
        began = time.perf_counter()
        for i in range(steps):
            result = await asyncio.to_thread(self.backend.train_step, batch, obj.loss_fn(prep), self.temperature,
                                             obj.needs_entropy)
            if i == 0:
                record.metrics = {**obj.metrics(prep), **result.metrics,
                                  "reward_mean": float(batch.rewards.mean())}
            record.loss, record.grad_norm = result.loss, result.grad_norm
            if result.applied:
                self.version += 1
                record.applied += 1
            else:
                self.counters["skipped_steps"] += 1
                record.skipped_steps.append(result.reason)
                log.warning("step skipped at version %d: %s", self.version, result.reason)
                break  # the same batch would fail the same way
        record.times["train_s"] = time.perf_counter() - began


FAILURE_COUNTERS = ("reward_errors/", "metric_errors/", "tool_errors/")


def count_failures(counters: Counter[str], trajectories: list[Trajectory]) -> None:
    """Add the trajectories' failures by name (the env's own counters) to the trainer's counters."""
    for t in trajectories:
        for key, value in t.metrics.items():
            if value and key.startswith(FAILURE_COUNTERS):
                counters[key] += int(value)


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and Python: the same seed gives the same run on CPU."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
