"""A process pool for verifiers that are CPU-heavy or untrusted (pebble: per-call timeouts that
kill the worker, which concurrent.futures cannot do)."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import pebble


class VerifierPool:
    """Worker processes for `Env.verify`. One per rollout worker; close it when done.

    Workers are spawned (not forked): the rollout process has threads and an event loop, which a
    fork would copy half-way. A call past its timeout gets its worker killed and replaced.
    """

    def __init__(self, workers: int = 2, max_tasks_per_worker: int = 0) -> None:
        self._pool = pebble.ProcessPool(
            max_workers=workers, max_tasks=max_tasks_per_worker, context=multiprocessing.get_context("spawn")
        )

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """`fn(*args)` in a worker; TimeoutError past `timeout_s`; the function's own exception if it raises."""
        future = self._pool.schedule(fn, args=list(args), timeout=timeout_s)
        try:
            return await asyncio.wrap_future(future)
        except FutureTimeoutError:
            raise TimeoutError(
                f"verifier {getattr(fn, '__name__', fn)} ran past {timeout_s} s (its worker was killed)"
            ) from None
        except asyncio.CancelledError:
            future.cancel()  # pebble stops the worker running a cancelled task
            raise

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
