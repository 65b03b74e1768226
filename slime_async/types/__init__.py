"""Types: the msgspec Structs shared by every part of slime_async, and their encodings.

Owns: Task, Message, ToolCall, Turn, Trajectory, Group, StopReason, the schema version, and how
these become bytes (msgpack on the wire, per-token arrays as raw little-endian bytes; JSON lines
in files). Does not own: behaviour (episodes, buffering, training), sockets or framing (that is
`transport`).
"""

from slime_async.types.codec import (
    DecodeError,
    SchemaVersionError,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)
from slime_async.types.core import (
    SCHEMA_VERSION,
    Group,
    Message,
    StopReason,
    Task,
    ToolCall,
    Trajectory,
    Turn,
    new_id,
)

__all__ = [
    "SCHEMA_VERSION",
    "DecodeError",
    "Group",
    "Message",
    "SchemaVersionError",
    "StopReason",
    "Task",
    "ToolCall",
    "Trajectory",
    "Turn",
    "from_json",
    "from_msgpack",
    "new_id",
    "to_json",
    "to_msgpack",
]
