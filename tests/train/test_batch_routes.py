"""Routed-experts records: from the engine's replies to turns, the wire, and batch rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_async.moe.routing import SequenceRoutes, decode_sglang, encode_sglang, turn_records
from slime_async.train.batch import build_batch
from slime_async.types import StopReason, Trajectory, Turn
from slime_async.types.codec import from_json, from_msgpack, to_json, to_msgpack

W = 3  # layers x top_k


def reply(start: int, stop: int, seed: int = 0) -> np.ndarray:
    """Made-up expert ids for positions start..stop-1, flat int32 (position p's ids are p, p+1, p+2 mod 8)."""
    return np.array([[(p + j + seed) % 8 for j in range(W)] for p in range(start, stop)], np.int32).reshape(-1)


def test_each_request_asks_from_the_previous_replys_last_token_and_a_new_branch_starts_over() -> None:
    routes = SequenceRoutes(W, num_experts=8)
    prompt = np.arange(5)
    assert routes.start_len(prompt) == 0
    out = np.array([7, 8, 9])
    rows = routes.add(prompt, out, 0, reply(0, 7))  # fed: 5 prompt + 2 of the 3 outputs
    assert rows.shape == (7, W) and rows.dtype == np.uint8
    second = np.concatenate([prompt, out, [4, 4]])
    assert routes.start_len(second) == 7  # position 7 (the last output) was never fed
    rows = routes.add(second, np.array([1]), 7, reply(7, 10))
    np.testing.assert_array_equal(rows, reply(0, 10).reshape(10, W))
    assert routes.start_len(np.array([9, 9, 9])) == 0  # not an extension: a new branch


@pytest.mark.parametrize(("ids", "why"), [(reply(0, 6), "expected 7 positions"),
                                          (reply(0, 7) + 8, "outside 0..7")])
def test_a_reply_of_the_wrong_size_or_with_foreign_ids_is_refused(ids: np.ndarray, why: str) -> None:
    with pytest.raises(ValueError, match=f"meta_info.routed_experts: .*{why}"):
        SequenceRoutes(W, 8).add(np.arange(5), np.arange(3), 0, ids)


def test_sglang_wire_is_base64_int32() -> None:
    ids = reply(0, 4)
    assert np.array_equal(decode_sglang(encode_sglang(ids), W).reshape(-1), ids)
    with pytest.raises(ValueError, match="not a whole number of rows"):
        decode_sglang(encode_sglang(ids[:-1]), W)
    with pytest.raises(ValueError, match="not base64"):
        decode_sglang("@@@", W)


def test_turn_records_mark_the_unreported_final_token() -> None:
    rows = reply(0, 8).reshape(8, W).astype(np.uint8)
    first, second = turn_records([4, 5], rows)
    np.testing.assert_array_equal(first, rows[:4].reshape(-1))
    np.testing.assert_array_equal(second.reshape(5, W)[:4], rows[4:])
    assert (second.reshape(5, W)[4] == 255).all()


def turn(prompt: int, completion: int, routes: np.ndarray | None, new_branch: bool = False) -> Turn:
    return Turn(prompt_ids=np.arange(prompt), completion_ids=np.arange(completion), logprobs=np.full(completion, -1.0),
                versions=np.zeros(completion, np.int32), routed_experts=routes, new_branch=new_branch)


def traj(*turns: Turn) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", sample_index=0, turns=list(turns), stop_reason=StopReason.DONE,
                      reward=1.0)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_records_cross_both_wires_in_their_dtype(dtype: type) -> None:
    marker = 255 if dtype is np.uint8 else -1
    ids = np.array([1, 2, 3, 4, 5, marker] * 2, dtype)
    t = traj(turn(2, 2, ids))
    for back in (from_msgpack(to_msgpack(t), Trajectory), from_json(to_json(t), Trajectory)):
        got = back.turns[0].routed_experts
        assert got is not None and got.dtype == np.dtype(dtype) and np.array_equal(got, ids)


def test_a_record_that_is_not_whole_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number per token"):
        turn(2, 2, np.zeros(7, np.uint8))


def test_batch_rows_carry_the_record_with_minus_one_where_unreported() -> None:
    first = np.arange(4 * W, dtype=np.uint8) % 8
    second = np.full(3 * W, 255, np.uint8)
    second[:W] = 7
    built = build_batch([traj(turn(2, 2, first), turn(1, 2, second)), traj(turn(3, 2, None))], max_seq_len=6,
                        route_width=W)
    batch = built.batch
    assert batch is not None and batch.routed_experts is not None
    assert batch.routed_experts.shape == (2, 6, W) and batch.routed_experts.dtype == torch.int16
    row = batch.routed_experts[0]
    assert torch.equal(row[:4].reshape(-1), torch.from_numpy(first.astype(np.int16)))
    assert (row[4] == 7).all() and (row[5] == -1).all()  # cut at 6 tokens of 7; 255 -> -1
    assert (batch.routed_experts[1] == -1).all() and built.unrouted == 1
    assert batch.rows(1, 2).routed_experts.shape[1] == 5  # a micro-batch trims it like the tokens


def test_a_new_branch_is_its_own_row_with_its_own_record() -> None:
    a, b = np.zeros(4 * W, np.uint8), np.ones(5 * W, np.uint8)
    built = build_batch([traj(turn(2, 2, a), turn(3, 2, b, new_branch=True))], max_seq_len=16, route_width=W)
    assert built.batch is not None and built.batch.routed_experts is not None
    assert (built.batch.routed_experts[0, :4] == 0).all() and (built.batch.routed_experts[1, :5] == 1).all()
    assert built.unrouted == 0


def test_without_a_route_width_batches_carry_no_record() -> None:
    built = build_batch([traj(turn(2, 2, np.zeros(4 * W, np.uint8)))], max_seq_len=8)
    assert built.batch is not None and built.batch.routed_experts is None
