"""NCCL mode: the trainer (rank 0) broadcasts each tensor to the engines' ranks.

SGLang's protocol: `/init_weights_update_group {master_address, master_port, rank_offset,
world_size, group_name, backend}` makes every engine rank join a process group with the trainer
(the request returns once the group is formed), then per bucket
`/update_weights_from_distributed {names, dtypes, shapes, weight_version}` makes the engines receive
the tensors that rank 0 broadcasts meanwhile, in the listed order.

Tested here: the protocol over gloo on CPU, against a receiver process that decodes SGLang's request
bodies and joins the group the way SGLang does (`tests/sync/gloo_receiver.py`), and the embedded
engine's refusal (501, not retried). Not tested: NCCL itself and a real SGLang server (neither runs
on the CPU machines). Each engine is assumed to have one rank (tensor parallel size 1); rank
offsets follow the URL order.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from slime_async.config.schema import SyncConfig
from slime_async.sync.buckets import bucket_named_tensors
from slime_async.sync.push import NamedWeights, Prepared

GROUP_NAME = "weight_update_group"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_weight_update_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    timeout: datetime.timedelta, abandoned: threading.Event | None = None,
) -> Any:
    """A process group outside the default one, formed the way SGLang's receiving side forms it
    (`tcp://` rendezvous, rank 0 hosting the store, keys under `group_name`), so both sides meet.

    Used by the trainer (rank 0) here, and by the receiving side of the gloo test. Returns None
    if `abandoned` is set when the rendezvous ends (an engine refused: no group is formed).
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    if abandoned is not None and abandoned.is_set():
        return None
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class NcclBroadcaster:
    """One process group (trainer = rank 0, engine i = rank 1 + i), formed on the first push."""

    def __init__(self, publisher: Any, cfg: SyncConfig) -> None:
        self.publisher = publisher
        self.cfg = cfg
        self.group: Any = None
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._lock = asyncio.Lock()
        self._broadcast_lock = asyncio.Lock()
        self._abandoned = threading.Event()

    @staticmethod
    def _in_daemon_thread(fn: Any, *args: Any) -> tuple[asyncio.Future, threading.Thread]:
        """Run a blocking rendezvous in a daemon thread: if an engine refuses, nothing waits for it
        (the default executor's threads are joined at loop shutdown, which would wait for the timeout).
        The future settles just before the thread ends: join the thread where it must be gone."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        def run() -> None:
            result, error = None, None
            try:
                result = fn(*args)
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop may be gone by then
                loop.call_soon_threadsafe(settle, result, error)

        thread = threading.Thread(target=run, name="weight-update-group", daemon=True)
        thread.start()
        return future, thread

    def _form_group(self, port: int, world_size: int) -> Any:
        return init_weight_update_group(self.backend, self.cfg.nccl_master_address, port, 0, world_size,
                                        GROUP_NAME, datetime.timedelta(seconds=self.cfg.timeout_s),
                                        abandoned=self._abandoned)

    def _abandon(self, port: int, world_size: int) -> None:
        """An engine refused to join: end the trainer's rendezvous now rather than at its timeout.

        The rendezvous thread waits inside torch's C++ (the store counts its ranks); a process that
        exits while a thread waits there aborts (CI's pytest did, once). Stand-in clients make up the
        count (the store waits for at least the world size), and the thread, seeing `_abandoned`,
        forms no group."""
        self._abandoned.set()
        timeout = datetime.timedelta(seconds=self.cfg.timeout_s)
        with contextlib.suppress(Exception):  # the thread may already have given up: nothing to end
            for _ in range(world_size - 1):
                dist.TCPStore(self.cfg.nccl_master_address, port, world_size, False, timeout)

    async def _ensure_group(self) -> None:
        async with self._lock:
            if self.group is not None:
                return
            urls = self.publisher.urls
            port = self.cfg.nccl_master_port or _free_port()
            world = 1 + len(urls)
            self._abandoned.clear()
            forming, thread = self._in_daemon_thread(self._form_group, port, world)
            inits = [asyncio.ensure_future(self.publisher.post(u, "/init_weights_update_group", {
                "master_address": self.cfg.nccl_master_address, "master_port": port, "rank_offset": 1 + i,
                "world_size": world, "group_name": GROUP_NAME, "backend": self.backend,
            })) for i, u in enumerate(urls)]
            try:
                # an engine's refusal (501) arrives long before the rendezvous would time out
                await asyncio.gather(*inits)
            except BaseException:
                for t in inits:
                    t.cancel()
                await asyncio.to_thread(self._abandon, port, world)
                with contextlib.suppress(Exception):
                    await forming  # returns at once now; no thread is left inside torch
                # and the thread itself is gone (it settled the future on its way out; CI once saw it
                # still alive at that instant)
                await asyncio.to_thread(thread.join, self.cfg.timeout_s)
                raise
            self.group = await forming

    async def push(self, buckets: list[dict[str, torch.Tensor]], version: int) -> None:
        """Broadcast every bucket; all engines take part in each broadcast, so one push serves all."""
        await self._ensure_group()
        async with self._broadcast_lock:
            # every engine paused in place first (the publisher continues each once whole): an unpaused
            # SGLang engine would hold its part of the broadcast until its running requests finish
            await asyncio.gather(*(self.publisher.pause(u) for u in self.publisher.urls))
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = {
                    "names": list(bucket), "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
                    "shapes": [list(t.shape) for t in bucket.values()], "group_name": GROUP_NAME,
                    "flush_cache": False,  # requests paused in place keep running: SGLang refuses a flush
                }
                if last:
                    body["weight_version"] = str(version)
                posts = [self.publisher.post(u, "/update_weights_from_distributed", body)
                         for u in self.publisher.urls]
                await asyncio.gather(*posts, asyncio.to_thread(self._broadcast, bucket))

    def _broadcast(self, bucket: dict[str, torch.Tensor]) -> None:
        for t in bucket.values():
            dist.broadcast(t.contiguous(), src=0, group=self.group)

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None


def prepare_nccl(nccl: NcclBroadcaster, weights: NamedWeights, version: int, limit: int) -> Prepared:
    """Bucket the weights; returns the per-engine push (one broadcast shared by every engine), the bytes
    and the number of buckets."""
    named = list(weights())
    buckets = bucket_named_tensors(named, limit)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    shared: list[asyncio.Future] = []

    async def push_nccl(url: str) -> None:
        # one broadcast reaches every engine: the per-engine pushes share it (a failed one restarts)
        if not shared or (shared[0].done() and shared[0].exception() is not None):
            shared[:] = [asyncio.ensure_future(nccl.push(buckets, version))]
        await asyncio.shield(shared[0])

    return push_nccl, nbytes, len(buckets)
