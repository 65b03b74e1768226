"""Transport: how trajectories travel from rollout workers to the buffer over ZeroMQ.

Owns: the wire messages (`protocol`: DEALER senders -> one ROUTER server, msgpack frames of the
`types` Structs), reading a frame or rejecting it with a reason (`frames`), the senders
(`AsyncSender` for asyncio code, `SyncSender` for plain code) with their acks, resends, credit-based
flow control and heartbeats (`sender_core` holds the rules, `sender` the sockets), and who may
connect (`security`: loopback by default, CURVE keys required off loopback, `generate_keys`).

Does not own: what the buffer does with a trajectory (grouping, staleness, sampling, the WAL: that
is `buffer`, whose server speaks this protocol), or the Structs themselves (`types`).

Delivery is at-least-once (resent until acked) and the buffer de-duplicates by trajectory id, so
the trainer sees each trajectory exactly once.
"""

from slime_async.transport.frames import Rejected, RejectReason, check_values, decode_trajectory
from slime_async.transport.security import (
    CurveKeys,
    InsecureEndpointError,
    generate_keys,
    is_loopback,
)
from slime_async.transport.sender import AsyncSender, SyncSender
from slime_async.transport.sender_core import SenderStats

__all__ = [
    "AsyncSender",
    "CurveKeys",
    "InsecureEndpointError",
    "RejectReason",
    "Rejected",
    "SenderStats",
    "SyncSender",
    "check_values",
    "decode_trajectory",
    "generate_keys",
    "is_loopback",
]
