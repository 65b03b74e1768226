"""`TaskStream`: tasks from a row source in a seeded order, epoch after epoch, resumable from a saved state.

The order of epoch e is a permutation drawn from (seed, e) alone, so a stream restored from a
`DataState` continues exactly where the saved one was, without replaying anything. Bad rows are a
policy (`on_bad_row`): skipped and counted (the default; the first errors are kept for people), or
raised. A whole epoch without one good row is an error, never an endless loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import msgspec
import numpy as np

from slime_async.data.rows import BadRow, RowFormat, row_to_task
from slime_async.data.sources import RowSource
from slime_async.types import Task

log = logging.getLogger(__name__)

OnBadRow = Literal["skip", "raise"]
MAX_KEPT_ERRORS = 20


class DataState(msgspec.Struct, kw_only=True):
    """Where a stream is: what a checkpoint saves (`msgspec.json.encode(state)`) and a restart restores."""

    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0
    index: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Rows of this epoch's order already read (handed out or skipped)."""
    served: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Tasks handed out since the start of the run, over all epochs."""
    skipped: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Bad rows skipped since the start of the run."""
    source: str = ""
    """What the position is in: the source's name, row count, seed, shuffle and shard. A stream
    refuses to resume from the position of another (the dataset or its order changed)."""


class TooManyBadRows(ValueError):
    """More rows were bad than `max_skipped` allows (or `on_bad_row` is `raise`)."""


class TaskStream(Iterator[Task]):
    """An iterator of Tasks over a row source: give it to the Scheduler as its `tasks`.

    `epochs=None` cycles for ever. `validate(task)` may raise ValueError to reject a row (e.g. an
    unknown environment name): it is then a bad row like any other. `state()` is the offset to
    save; pass it back as `state=` to resume. `shard=(i, k)`: this stream takes every k-th row of
    each epoch's order, starting at i (rollout worker i of k): together the k streams see each row
    once per epoch.
    """

    def __init__(
        self,
        source: RowSource,
        fmt: RowFormat | None = None,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epochs: int | None = 1,
        on_bad_row: OnBadRow = "skip",
        max_skipped: int | None = None,
        validate: Callable[[Task], None] | None = None,
        state: DataState | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        if len(source) == 0:
            raise ValueError(f"data source {source.name} has no rows")
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        if count > len(source):
            raise ValueError(f"data source {source.name} has {len(source)} rows, fewer than the {count} shards")
        self.shard = shard
        self.source, self.fmt = source, fmt or RowFormat()
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.on_bad_row, self.max_skipped, self.validate = on_bad_row, max_skipped, validate
        fingerprint = f"{source.name}:{len(source)}:seed={seed}:shuffle={shuffle}:shard={shard[0]}/{shard[1]}"
        if state is not None and state.source and state.source != fingerprint:
            raise ValueError(f"data state is of {state.source}, not of {fingerprint}: the dataset, seed or "
                             "shard changed since it was saved; remove the state file to start over")
        self._state = msgspec.structs.replace(state, source=fingerprint) if state is not None else \
            DataState(source=fingerprint)
        self.errors: list[str] = []
        """The first bad rows' messages (at most MAX_KEPT_ERRORS), each naming its place."""
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self._good_this_epoch = self._state.index > 0  # a resumed epoch may have had good rows already

    def state(self) -> DataState:
        """A copy of the current position and counts."""
        return msgspec.structs.replace(self._state)

    def __iter__(self) -> TaskStream:
        return self

    def __next__(self) -> Task:
        s = self._state
        while True:
            if self.epochs is not None and s.epoch >= self.epochs:
                raise StopIteration
            order = self._order_of(s.epoch)
            if s.index >= len(order):
                if not self._good_this_epoch:
                    raise TooManyBadRows(f"data source {self.source.name}: epoch {s.epoch} had no usable row "
                                         f"({s.skipped} skipped; first: {self.errors[:1]})")
                s.epoch, s.index, self._good_this_epoch = s.epoch + 1, 0, False
                continue
            i = int(order[s.index])
            s.index += 1
            try:
                task = self._task(i)
            except BadRow as exc:
                self._bad(exc)
                continue
            s.served += 1
            self._good_this_epoch = True
            return task

    def _task(self, i: int) -> Task:
        raw, place = self.source.row(i)
        task = raw if isinstance(raw, Task) else row_to_task(raw, self.fmt, place, f"{self.source.name}:{i}")
        if self.validate is not None:
            try:
                self.validate(task)
            except ValueError as exc:
                raise BadRow(place, str(exc)) from None
        return task

    def _order_of(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.source)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = order[self.shard[0] :: self.shard[1]]
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def _bad(self, exc: BadRow) -> None:
        if self.on_bad_row == "raise":
            raise exc
        self._state.skipped += 1
        if len(self.errors) < MAX_KEPT_ERRORS:
            self.errors.append(str(exc))
            log.warning("skipping bad row: %s", exc)
        if self.max_skipped is not None and self._state.skipped > self.max_skipped:
            raise TooManyBadRows(f"{self._state.skipped} bad rows skipped, more than data.max_skipped="
                                 f"{self.max_skipped}; last: {exc}") from exc
