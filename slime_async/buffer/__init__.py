"""Buffer: the partial-off-policy buffer between rollout workers and the trainer.

Owns: group assembly (a group is released when complete, or smaller after `group_timeout_s`,
counted), the staleness bound (trainer version - oldest token version never above
`rollout.max_staleness`; drops counted by reason), sampling policies (`policies`: FIFO, freshest,
or your own typed function), batches for the trainer, the write-ahead log (`wal`) and compaction,
and the accounting `received == trained + buffered + dropped` (`core.Buffer`). The server
(`server.BufferServer`, its own process) puts the buffer behind the transport's ROUTER socket;
the trainer talks to it with `client.BufferClient` (`get_batch`, `set_version`, `metrics`).

Does not own: the wire, acks, credits or keys (`transport`), or what the trainer does with a batch.
"""

from slime_async.buffer.client import BufferClient
from slime_async.buffer.core import AccountingError, Batch, Buffer
from slime_async.buffer.policies import POLICIES, SamplingPolicy, fifo, freshest
from slime_async.buffer.server import BufferServer, ServerSettings
from slime_async.buffer.wal import WALCorruptError, WriteAheadLog

__all__ = [
    "POLICIES",
    "AccountingError",
    "Batch",
    "Buffer",
    "BufferClient",
    "BufferServer",
    "SamplingPolicy",
    "ServerSettings",
    "WALCorruptError",
    "WriteAheadLog",
    "fifo",
    "freshest",
]
