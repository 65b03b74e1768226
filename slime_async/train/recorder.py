"""What the trainer records for the dashboard at each step, beside `metrics.jsonl`.

- the trajectories the step trained, with the advantage each got, into the trajectory store
  (`store.TrajectoryWriter`), on a thread of their own so the trainer never waits on the disk;
- the buffer's books (`received = trained + buffered + dropped by reason`) as the buffer counts them
  after the step, one line per step in `<run dir>/buffer.jsonl` (the buffer server keeps them only in
  memory, and the summary has only the last).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from slime_async.dashboard.store import TrajectoryWriter
from slime_async.train import advantages as A
from slime_async.types import Trajectory

log = logging.getLogger(__name__)

BUFFER_BOOKS = "buffer.jsonl"


def advantages_of(trajectories: list[Trajectory], estimator: str) -> list[float]:
    """Each trajectory's sequence advantage as the trainer computes it from the batch's rewards
    (`reinforce_pp`: before its whitening over the batch's tokens, i.e. reward - group mean)."""
    if not trajectories:
        return []
    index: dict[str, int] = {}
    group_index = torch.tensor([index.setdefault(t.group_id, len(index)) for t in trajectories])
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    grpo = estimator == "grpo"
    adv = A.grpo_advantages(rewards, group_index) if grpo else A.dr_grpo_advantages(rewards, group_index)
    return [float(a) for a in adv]


class RunRecorder:
    """Call `on_step` after each trainer step; `close` at the end (waits for the last writes)."""

    def __init__(self, run_dir: Path, tokenizer: Any, estimator: str, buffer_client: Any | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # a trainer may start before anything else wrote there
        self.estimator = estimator
        self.buffer_client = buffer_client
        # one thread owns the SQLite connection: the writer is made and used there only
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajectory-store")
        self._writer: TrajectoryWriter | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._pool.submit(self._open, tokenizer).result()

    def _open(self, tokenizer: Any) -> None:
        self._writer = TrajectoryWriter(self.run_dir, tokenizer, self.estimator)

    def roll_back(self, version: int) -> None:
        """The trainer came back from the checkpoint at `version`: later steps leave the store."""
        self._pool.submit(lambda: self._writer and self._writer.roll_back(version)).result()
        path = self.run_dir / BUFFER_BOOKS
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if _version(line) <= version]
            path.write_text("".join(f"{line}\n" for line in kept))

    def on_step(self, version: int, applied: int, trajectories: list[Trajectory]) -> None:
        if applied and trajectories:
            adv = advantages_of(trajectories, self.estimator)
            batch = list(trajectories)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(self._append, version, batch, adv, version - applied))
        self._books(version)

    def _append(self, version: int, batch: list[Trajectory], adv: list[float], trained_from: int) -> None:
        try:
            assert self._writer is not None
            self._writer.append(version, batch, adv, trained_from)
        except Exception:  # the store is a view: a failure to write it must not stop training
            log.exception("trajectory store: could not record the step at version %d", version)

    def _books(self, version: int) -> None:
        if self.buffer_client is None:
            return
        try:
            books = self.buffer_client.metrics(timeout=2.0)
        except TimeoutError:
            return  # a busy or restarting buffer: this step has no line, the next one will
        with (self.run_dir / BUFFER_BOOKS).open("a") as f:
            f.write(json.dumps({"version": version, "time": time.time(), **books}) + "\n")

    def close(self) -> None:
        for f in self._pending:
            f.result()
        self._pool.submit(lambda: self._writer and self._writer.close()).result()
        self._pool.shutdown()


def _version(line: str) -> int:
    try:
        return int(json.loads(line).get("version", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 1 << 62  # a line cut by a crash: dropped with the undone steps
