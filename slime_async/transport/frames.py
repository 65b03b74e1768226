"""Reading one trajectory frame off the wire, or saying exactly why it cannot be read.

Everything that arrives from a socket goes through `decode_trajectory`, which never raises anything
but `Rejected`: the server counts the reason, logs the detail, tells the sender, and carries on.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from slime_async.types import DecodeError, SchemaVersionError, Trajectory, from_msgpack

LOGPROB_SLACK = 1e-3
"""A logprob is at most 0; servers' float paths can round it a little above."""


class RejectReason(enum.Enum):
    """Why a message from a peer was refused. Each has its own counter in the server's metrics."""

    OVERSIZED = "oversized"
    """The frame is larger than `buffer.max_frame_bytes`."""
    TRUNCATED = "truncated"
    """The frame ends in the middle of a value."""
    SCHEMA_VERSION = "schema_version"
    """The frame was written by a newer schema version than the server's."""
    INVALID = "invalid"
    """Valid msgpack, but not a valid Trajectory (a missing field, a wrong type, arrays that disagree
    in length), or values no episode produces (`check_values`)."""
    GARBAGE = "garbage"
    """Not msgpack at all."""
    BAD_MESSAGE = "bad_message"
    """The multipart envelope is wrong: unknown kind, missing or malformed frames."""
    OVER_CAPACITY = "over_capacity"
    """Sent past the credits the server granted (a sender that ignores flow control), or, from a
    sender it does not know, while the buffer is full: not stored (a sender that knows the protocol
    never sees it)."""


class Rejected(ValueError):
    """A message that the server refuses; `reason` is counted, the message is logged and sent back."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def decode_trajectory(frame: bytes | memoryview, max_bytes: int) -> Trajectory:
    """Decode one DATA frame as a Trajectory, or raise `Rejected` naming the reason and the place."""
    if len(frame) > max_bytes:
        raise Rejected(
            RejectReason.OVERSIZED,
            f"frame of {len(frame):,} bytes exceeds buffer.max_frame_bytes={max_bytes:,}",
        )
    try:
        trajectory = from_msgpack(frame, Trajectory)
    except SchemaVersionError as exc:
        raise Rejected(RejectReason.SCHEMA_VERSION, str(exc)) from None
    except DecodeError as exc:
        text = str(exc)
        if "truncated" in text:
            raise Rejected(RejectReason.TRUNCATED, text) from None
        if "malformed" in text or "trailing" in text.lower():
            raise Rejected(RejectReason.GARBAGE, text) from None
        raise Rejected(RejectReason.INVALID, text) from None
    except Exception as exc:  # any other failure of a decoder on hostile bytes is still a rejection
        raise Rejected(RejectReason.GARBAGE, f"{type(exc).__name__}: {exc}") from None
    problem = check_values(trajectory)
    if problem is not None:
        raise Rejected(RejectReason.INVALID, problem)
    return trajectory


def check_values(t: Trajectory) -> str | None:
    """What makes a well-typed trajectory one that no episode produces, naming the place; None if
    nothing. Such a trajectory would poison a training step (a NaN reward or logprob makes the
    loss NaN; a negative token id indexes the vocabulary from its end)."""
    if not math.isfinite(t.reward):
        return f"reward: {t.reward}"
    for name, table in (("rewards", t.rewards), ("metrics", t.metrics), ("timings", t.timings)):
        for key, value in table.items():
            if not math.isfinite(value):
                return f"{name}[{key!r}]: {value}"
    if t.sample_index < 0:
        return f"sample_index: {t.sample_index}"
    # on the buffer's receive path: one min/max reduction per array, the place found only when bad
    # (np.isin and boolean masks cost 5x the frame's own decode on a 4k-token trajectory)
    for i, turn in enumerate(t.turns):
        for field in ("prompt_ids", "completion_ids", "versions"):
            values = getattr(turn, field)
            if len(values) and values.min() < 0:
                return f"turns[{i}].{field}[{int(np.argmin(values))}]: {int(values.min())} (negative)"
        lps = turn.logprobs
        if len(lps) and not (lps.max() <= LOGPROB_SLACK and math.isfinite(lps.min())):  # NaN fails `<=`
            j = int(np.argmax(~np.isfinite(lps) | (lps > LOGPROB_SLACK)))
            return f"turns[{i}].logprobs[{j}]: {float(lps[j])} (a logprob is finite and at most 0)"
        mask = turn.loss_mask
        if mask is not None and len(mask) and mask.max() > 1:  # unsigned: 0 and 1 are the only others
            return f"turns[{i}].loss_mask: values other than 0 and 1"
    return None
