"""Several trainer ranks, one loop: rank 0 talks to the buffer and the engines, the others follow.

Every rank runs the same `Trainer` over its own backend (Megatron's tensor and data-parallel
collectives need every rank in every forward, backward and weight export). Only rank 0 holds a
buffer client and a weight publisher; the others get stand-ins that receive what rank 0 decided
over a gloo *control group* (its own process group, apart from the backend's):

    rank 0                                    ranks 1..N-1
    LeaderSource.get_batch -> buffer  ──BATCH──▶ FollowerSource.get_batch (same trajectories)
    LeaderSink.publish: weights()     ──EXPORT─▶ FollowerSink: iterate named_weights (collective)
                      HTTP to engines ──DONE───▶ (the report, so counters agree)
    Trainer.run: each step            ◀─DECIDE─▶ every rank votes; the largest vote wins
    an error anywhere on rank 0       ──ABORT──▶ followers raise `RanksAborted` with its message

Each message is one collective: a small header gathered from every rank (rank 0's kind and payload
size; each rank's stop vote), then rank 0's payload broadcast. A SIGTERM to any rank is its vote at
the next DECIDE, so all ranks end after the same step. Waits are bounded by `control_timeout`
(`train.control_timeout_s`): a follower gives up on a hung rank 0 with an error, and a rank 0 that
died closes its sockets, which the others notice at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Iterable
from enum import IntEnum
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from slime_async.config.schema import Config
from slime_async.sync.publisher import NamedWeights, PublishReport
from slime_async.train.loop import BatchSource, WeightSink
from slime_async.types import Trajectory, from_msgpack, to_msgpack

log = logging.getLogger(__name__)

DEFAULT_CONTROL_TIMEOUT_S = 300.0
"""The least a follower waits for rank 0's next message (`train.control_timeout_s: null`)."""
ABORT_WAIT_S = 30.0
"""How long rank 0 tries to hand its error to the others before it exits anyway (they may be inside
a backend collective instead of a control wait; its exit then ends theirs)."""


class Kind(IntEnum):
    """What rank 0 says in one control message."""

    FOLLOW = 0
    """A follower's own header (only rank 0's kind counts)."""
    DECIDE = 1
    BATCH = 2
    EXPORT = 3
    DONE = 4
    AGREE = 5
    ABORT = 6


class RanksAborted(RuntimeError):
    """Rank 0 stopped the run with an error, or could not be reached within the control timeout."""


def control_timeout(cfg: Config) -> float:
    """`train.control_timeout_s`, or (None) the longest stretch rank 0 may spend without a control
    message plus a minute, at least `DEFAULT_CONTROL_TIMEOUT_S`."""
    if cfg.train.control_timeout_s is not None:
        return cfg.train.control_timeout_s
    s = cfg.sync
    # one publish: the engines' version check, then every attempt with its backoff
    publish = s.timeout_s + (s.retries + 1) * s.timeout_s + s.retry_backoff_s * (2 ** s.retries - 1)
    return max(DEFAULT_CONTROL_TIMEOUT_S, cfg.train.batch_timeout_s + 60.0, publish + 60.0)


class ControlGroup:
    """The trainer ranks' control channel: a gloo group of every rank. Each call is collective."""

    def __init__(self, timeout_s: float) -> None:
        if not dist.is_initialized():
            raise ValueError("train.world_size > 1: the control group needs torch.distributed (--dist-init)")
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # gloo also when the backend's default group is NCCL: small CPU messages, a timeout of its own
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, kind: Kind = Kind.FOLLOW, payload: bytes = b"", vote: int = 0,
                 timeout_s: float | None = None) -> tuple[Kind, bytes, int]:
        """Rank 0's (kind, payload) to every rank, with the largest vote of all ranks. A follower that
        receives ABORT raises `RanksAborted` with rank 0's message."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        header = torch.tensor([int(kind), len(payload) if self.leader else 0, vote], dtype=torch.int64)
        headers = [torch.empty_like(header) for _ in range(self.world_size)]
        self._wait(dist.all_gather(headers, header, group=self.group, async_op=True), timeout, "a message")
        sent, size, _ = (int(x) for x in headers[0])
        votes = max(int(h[2]) for h in headers)
        data = b""
        if size:
            buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.leader
                   else torch.empty(size, dtype=torch.uint8))
            self._wait(dist.broadcast(buf, group_src=0, group=self.group, async_op=True), timeout, "its payload")
            data = buf.numpy().tobytes()
        if sent == Kind.ABORT and not self.leader:
            raise RanksAborted(f"rank 0 stopped the run: {data.decode(errors='replace')}")
        return Kind(sent), data, votes

    def expect(self, want: Kind, vote: int = 0) -> tuple[bytes, int]:
        """A follower's side of one message that must be `want`."""
        kind, data, votes = self.exchange(Kind.FOLLOW, vote=vote)
        if kind != want:
            raise RanksAborted(f"rank {self.rank} expected {want.name} from rank 0 but got {kind.name}: "
                               "the ranks' loops went out of step")
        return data, votes

    def abort(self, message: str) -> None:
        """Rank 0: tell the followers the run ends with `message` (best effort, bounded)."""
        try:
            self.exchange(Kind.ABORT, message.encode(), timeout_s=min(self.timeout_s, ABORT_WAIT_S))
        except Exception as exc:  # they may be gone or busy elsewhere: exiting ends their waits too
            log.warning("could not tell the other ranks that the run stops: %s", exc)

    def _wait(self, work: Any, timeout: float, what: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise RanksAborted(self._lost(f"waiting for {what}: {exc}", timeout)) from None
        if ok is False:
            raise RanksAborted(self._lost(f"no {what} within {timeout:.0f} s", timeout))

    def _lost(self, detail: str, timeout: float) -> str:
        peer = "rank 0" if not self.leader else "the other ranks"
        return (f"rank {self.rank}: lost {peer} ({detail}); if it is alive but slow, raise "
                f"train.control_timeout_s (now {timeout:.0f} s)")

    # --- what the trainer loop asks ------------------------------------------------------------

    def decide(self, vote: int) -> int:
        """Every rank's stop vote (0: go on); all get the largest."""
        if self.leader:
            return self.exchange(Kind.DECIDE, vote=vote)[2]
        return self.expect(Kind.DECIDE, vote)[1]

    def agree(self, value: str | None) -> str | None:
        """Rank 0's `value` on every rank (e.g. which checkpoint to resume)."""
        if self.leader:
            self.exchange(Kind.AGREE, msgspec.msgpack.encode(value))
            return value
        return msgspec.msgpack.decode(self.expect(Kind.AGREE)[0], type=str | None)

    def barrier(self) -> None:
        """Every rank got here (bounded by the control timeout)."""
        self._wait(dist.barrier(group=self.group, async_op=True), self.timeout_s, "the other ranks at a barrier")


class LeaderSource:
    """Rank 0's `BatchSource`: the buffer's batch, handed to every follower."""

    def __init__(self, inner: BatchSource, control: ControlGroup) -> None:
        self.inner = inner
        self.control = control

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        batch = self.inner.get_batch(n, timeout) or []
        self.control.exchange(Kind.BATCH, msgspec.msgpack.encode([to_msgpack(t) for t in batch]))
        return batch

    def set_version(self, version: int) -> None:
        self.inner.set_version(version)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def __getattr__(self, name: str) -> Any:  # `received`, `last`: the buffer source's figures
        return getattr(self.inner, name)


class FollowerSource:
    """A follower's `BatchSource`: whatever rank 0 got from the buffer."""

    def __init__(self, control: ControlGroup) -> None:
        self.control = control

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        frames = msgspec.msgpack.decode(self.control.expect(Kind.BATCH)[0], type=list[bytes])
        return [from_msgpack(f, Trajectory) for f in frames]

    def set_version(self, version: int) -> None:
        """Rank 0 tells the buffer."""

    def commit(self, version: int) -> None:
        """Rank 0 tells the buffer."""


class LeaderSink:
    """Rank 0's `WeightSink`: the publisher, with every weight export and every result announced."""

    def __init__(self, inner: WeightSink, control: ControlGroup) -> None:
        self.inner = inner
        self.control = control

    def _announced(self, weights: NamedWeights) -> NamedWeights:
        def export() -> Iterable[tuple[str, torch.Tensor]]:
            # the followers start the same (collective) export now
            self.control.exchange(Kind.EXPORT)
            return weights()

        return export

    async def _done(self, result: Any) -> None:
        await asyncio.to_thread(self.control.exchange, Kind.DONE, msgspec.msgpack.encode(result))

    async def publish(self, weights: NamedWeights, version: int) -> PublishReport:
        report = await self.inner.publish(self._announced(weights), version)
        await self._done(report)
        return report

    async def reconcile(self, weights: NamedWeights, version: int) -> list[str]:
        behind = await self.inner.reconcile(self._announced(weights), version)
        await self._done(behind)
        return behind

    async def release_memory(self) -> list[str]:
        released = await self.inner.release_memory()
        await self._done(released)
        return released

    async def restore_memory(self, weights: NamedWeights, version: int) -> PublishReport:
        report = await self.inner.restore_memory(self._announced(weights), version)
        await self._done(report)
        return report

    async def close(self) -> None:
        await self.inner.close()


class FollowerSink:
    """A follower's `WeightSink`: joins each export rank 0 makes, returns rank 0's result."""

    def __init__(self, control: ControlGroup) -> None:
        self.control = control

    def _follow(self, weights: NamedWeights | None, result_type: Any) -> Any:
        while True:
            kind, data, _ = self.control.exchange(Kind.FOLLOW)
            if kind == Kind.EXPORT and weights is not None:
                for _ in weights():  # collective: every rank iterates to the end
                    pass
            elif kind == Kind.DONE:
                return msgspec.msgpack.decode(data, type=result_type)
            else:
                raise RanksAborted(f"rank {self.control.rank} expected EXPORT or DONE from rank 0 but got "
                                   f"{kind.name}: the ranks' loops went out of step")

    async def publish(self, weights: NamedWeights, version: int) -> PublishReport:
        return await asyncio.to_thread(self._follow, weights, PublishReport)

    async def reconcile(self, weights: NamedWeights, version: int) -> list[str]:
        return await asyncio.to_thread(self._follow, weights, list[str])

    async def release_memory(self) -> list[str]:
        return await asyncio.to_thread(self._follow, None, list[str])

    async def restore_memory(self, weights: NamedWeights, version: int) -> PublishReport:
        return await asyncio.to_thread(self._follow, weights, PublishReport)

    async def close(self) -> None:
        """Nothing to close: rank 0 holds the connections."""
