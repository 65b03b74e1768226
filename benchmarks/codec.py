"""Wire codec: a Trajectory through msgpack with per-token arrays as raw bytes vs as Python lists.

Justifies `types.arrays`: the same trajectory, encoded and decoded by the same msgspec, once with
numpy arrays as raw little-endian bytes (what slime_async sends) and once with the arrays as
Python lists (the obvious alternative).
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from benchmarks import Result
from slime_async.types import StopReason, Trajectory, Turn, from_msgpack, to_msgpack

DESCRIPTION = "msgpack round trip of a trajectory: per-token arrays as raw bytes vs as Python lists"


class _ListTurn(msgspec.Struct):
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    finish_reason: str = ""


class _ListTrajectory(msgspec.Struct):
    task_id: str
    group_id: str
    sample_index: int
    turns: list[_ListTurn]
    stop_reason: str
    id: str
    schema_version: int = 1


def _trajectory(tokens: int, rng: np.random.Generator) -> Trajectory:
    turn = Turn(
        prompt_ids=rng.integers(0, 150_000, 256),
        completion_ids=rng.integers(0, 150_000, tokens),
        logprobs=-rng.random(tokens).astype(np.float32),
        versions=np.full(tokens, 7),
    )
    return Trajectory(task_id="t", group_id="g", sample_index=0, turns=[turn], stop_reason=StopReason.DONE)


def _as_lists(traj: Trajectory) -> _ListTrajectory:
    turns = [
        _ListTurn(
            t.prompt_ids.tolist(), t.completion_ids.tolist(), t.logprobs.tolist(), t.versions.tolist(),
            t.loss_mask.tolist(),  # type: ignore[union-attr]
        )
        for t in traj.turns
    ]
    return _ListTrajectory(traj.task_id, traj.group_id, 0, turns, traj.stop_reason.value, traj.id)


def _rate(fn, seconds: float) -> float:
    """Calls per second of `fn`, over at least `seconds` after one warm-up call."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n / elapsed


def run(quick: bool = False) -> Result:
    seconds = 0.3 if quick else 1.5
    rng = np.random.default_rng(0)
    rows, ratios = [], {}
    for tokens in (256, 2048, 8192):
        traj = _trajectory(tokens, rng)
        as_lists = _as_lists(traj)
        frame, list_frame = to_msgpack(traj), msgspec.msgpack.encode(as_lists)
        list_decoder = msgspec.msgpack.Decoder(_ListTrajectory)
        arrays = _rate(lambda t=traj: from_msgpack(to_msgpack(t), Trajectory), seconds)
        lists = _rate(lambda t=as_lists, d=list_decoder: d.decode(msgspec.msgpack.encode(t)), seconds)
        ratios[tokens] = arrays / lists
        rows.append([tokens, "raw bytes", len(frame), arrays, arrays * len(frame) / 1e6])
        rows.append([tokens, "lists", len(list_frame), lists, lists * len(list_frame) / 1e6])
    headline = (
        f"round trips/s, raw bytes vs lists at 2,048 tokens: {ratios[2048]:.1f}x (goal >= 3x; docs/measured.md: ~4x)"
    )
    return Result(
        columns=["completion tokens", "arrays as", "frame bytes", "round trips/s", "MB/s"],
        rows=rows,
        headline=headline,
        details={"ratio_by_tokens": ratios},
    )
