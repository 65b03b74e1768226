"""Reading one trajectory frame off the wire, or saying exactly why it cannot be read.

Everything that arrives from a socket goes through `decode_trajectory`, which never raises anything
but `Rejected`: the server counts the reason, logs the detail, tells the sender, and carries on.
"""

from __future__ import annotations

import enum

from slime_async.types import DecodeError, SchemaVersionError, Trajectory, from_msgpack


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
    in length)."""
    GARBAGE = "garbage"
    """Not msgpack at all."""
    BAD_MESSAGE = "bad_message"
    """The multipart envelope is wrong: unknown kind, missing or malformed frames."""


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
        return from_msgpack(frame, Trajectory)
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
