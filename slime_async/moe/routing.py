"""The routed-experts record: which experts the engine chose for each token, for routing replay.

An MoE policy's logprobs depend on discrete expert choices. Tiny numeric differences between the
engine and the trainer flip some of them, and a flipped expert changes a token's logprob far more
than rounding does: importance ratios blow up. Routing replay records the engine's choices and has
the trainer's forward passes use them (the gradient still flows through the router's weights of
the chosen experts).

On the HTTP wire we speak SGLang's form: a request sets `return_routed_experts` (and
`routed_experts_start_len`), the reply's `meta_info.routed_experts` is base64 of int32
[positions, layers, top_k] covering the fed positions `[start_len, prompt + output - 1)` (the last
output token is never fed). On our own wire a `Turn` keeps one row per token of its prompt and
completion, flat, as uint8 (int16 past 255 experts); a row the engine never reported (the final
token, a client without the record) is all `UNKNOWN`, and the trainer routes that token itself.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

SGLANG_DTYPE = np.dtype("<i4")
SMALL, LARGE = np.dtype("u1"), np.dtype("<i2")


def route_dtype(num_experts: int) -> np.dtype:
    """The per-token record's dtype on a `Turn`: one byte while every id and the marker fit."""
    return SMALL if num_experts < 255 else LARGE


def unknown(dtype: np.dtype) -> int:
    """The marker of an unreported row: every bit set (255 in uint8, -1 in int16)."""
    return 255 if dtype == SMALL else -1


def decode_sglang(text: str, width: int, field: str = "meta_info.routed_experts") -> np.ndarray:
    """SGLang's base64 record as int32 [positions, width] (width = layers x top_k); ValueError naming
    `field` when it is not one."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(f"{field}: not base64 ({exc})") from None
    row = SGLANG_DTYPE.itemsize * width
    if width <= 0 or len(raw) % row:
        raise ValueError(f"{field}: {len(raw)} bytes is not a whole number of rows of {width} int32 expert ids")
    return np.frombuffer(raw, dtype=SGLANG_DTYPE).reshape(-1, width)


def encode_sglang(routes: np.ndarray) -> str:
    """int ids [positions, ...] as SGLang's base64 of little-endian int32."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=SGLANG_DTYPE).tobytes()).decode("ascii")


class SequenceRoutes:
    """One episode's routing record, position by position, kept by its policy across turns.

    Each request asks from the first position not yet reported (`start_len`): the previous reply's
    last token, which that call produced but never fed. A request whose input does not extend the
    sequence so far (a chat template that rewrote history: a new branch) starts again from 0."""

    def __init__(self, width: int, num_experts: int) -> None:
        self.width = width
        self.num_experts = num_experts
        self.dtype = route_dtype(num_experts)
        self._tokens = np.zeros(0, np.int64)
        self._rows = np.zeros((0, width), self.dtype)

    def start_len(self, input_ids: np.ndarray) -> int:
        """`routed_experts_start_len` for a request on `input_ids` (the whole context)."""
        n = len(self._tokens)
        if len(input_ids) < n or not np.array_equal(np.asarray(input_ids[:n]), self._tokens):
            self._tokens, self._rows = np.zeros(0, np.int64), np.zeros((0, self.width), self.dtype)
        return len(self._rows)

    def add(self, input_ids: np.ndarray, output_ids: np.ndarray, start: int, reply: np.ndarray) -> np.ndarray:
        """Take a reply's ids (int32, flat) for positions `start` .. prompt + output - 2 and return the
        record of every position so far, [positions, width] in the `Turn` dtype. A reply of the wrong
        size or with ids out of range is a ValueError naming the field (a server off the protocol)."""
        fed = max(len(input_ids) + len(output_ids) - 1 - start, 0)
        if reply.size != fed * self.width:
            raise ValueError(f"meta_info.routed_experts: {reply.size} expert ids, expected {fed} positions x "
                             f"{self.width} (layers x top_k) from routed_experts_start_len {start}")
        if reply.size and (int(reply.min()) < 0 or int(reply.max()) >= self.num_experts):
            raise ValueError(f"meta_info.routed_experts: expert ids {int(reply.min())}..{int(reply.max())} outside "
                             f"0..{self.num_experts - 1}")
        rows = reply.reshape(fed, self.width).astype(self.dtype)
        self._rows = np.concatenate([self._rows[:start], rows])
        self._tokens = np.concatenate([np.asarray(input_ids, np.int64), np.asarray(output_ids, np.int64)])
        return self._rows


def record_turns(turns: list[Any], rows: np.ndarray) -> bool:
    """Split a policy's routing record of the current sequence (from the latest turn that starts a new
    branch, to the last-but-one token) over that sequence's turns (`Turn.routed_experts`); each call
    re-covers the turns before it, whose last token is reported late. False (nothing set) when the
    record is not of these turns' tokens."""
    first = max((i for i, t in enumerate(turns) if t.new_branch), default=0)
    segment = turns[first:]
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in segment]
    if len(rows) != sum(lengths) - 1:
        return False
    for turn, record in zip(segment, turn_records(lengths, rows), strict=True):
        turn.routed_experts = record
    return True


def turn_records(lengths: list[int], rows: np.ndarray) -> list[np.ndarray]:
    """Split a sequence's record [positions, width] into flat per-turn records of `lengths` tokens each;
    positions past the record (the final token) are `unknown`."""
    total = sum(lengths)
    full = np.full((total, rows.shape[1]), unknown(rows.dtype), dtype=rows.dtype)
    known = min(len(rows), total)
    full[:known] = rows[:known]
    out, at = [], 0
    for n in lengths:
        out.append(full[at : at + n].reshape(-1))
        at += n
    return out
