"""A rollout worker stand-in, run as its own process by the end-to-end tests.

    python sender_main.py ENDPOINT PREFIX COUNT GROUP_SIZE [--sync] [--version V] [--tokens N]
                          [--curve-dir DIR] [--heartbeat S]

Sends COUNT trajectories with ids PREFIX-k (group PREFIX-g{k // GROUP_SIZE}), prints `ACK <id>` for
each ack and `NACK <id>` for each rejection as they arrive, then `DONE` once all are settled.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

from slime_async.transport import AsyncSender, SenderStats, SyncSender
from slime_async.types import StopReason, Trajectory, Turn


def make(prefix: str, k: int, group_size: int, version: int, tokens: int) -> Trajectory:
    return Trajectory(
        id=f"{prefix}-{k}", task_id=f"task-{prefix}-{k // group_size}", group_id=f"{prefix}-g{k // group_size}",
        sample_index=k % group_size, stop_reason=StopReason.DONE,
        turns=[Turn(prompt_ids=np.arange(8), completion_ids=np.arange(tokens) % 1000,
                    logprobs=np.full(tokens, -0.5, np.float32), versions=np.full(tokens, version))],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("prefix")
    ap.add_argument("count", type=int)
    ap.add_argument("group_size", type=int)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--version", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--curve-dir", default=None)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    a = ap.parse_args()
    out = sys.stdout
    kwargs = dict(
        curve_dir=a.curve_dir, name=a.prefix, heartbeat_s=a.heartbeat, heartbeat_timeout_s=5 * a.heartbeat,
        on_ack=lambda tid: (out.write(f"ACK {tid}\n"), out.flush()),
        on_nack=lambda tid, why: (out.write(f"NACK {tid} {why}\n"), out.flush()),
    )
    items = (make(a.prefix, k, a.group_size, a.version, a.tokens) for k in range(a.count))
    if a.sync:
        with SyncSender(a.endpoint, **kwargs) as sender:
            for t in items:
                sender.send(t)
            sender.flush()
            stats = sender.stats
    else:
        async def run() -> SenderStats:
            async with AsyncSender(a.endpoint, **kwargs) as sender:
                for t in items:
                    await sender.send(t)
                await sender.flush()
                return sender.stats

        stats = asyncio.run(run())
    print(f"STATS sessions={stats.sessions} resent={stats.resent} reconnects={stats.reconnects}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
