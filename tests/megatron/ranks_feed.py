"""A rollout-worker stand-in for test_ranks_loop.py: sends made-up trajectories to a buffer server.

    python ranks_feed.py ENDPOINT COUNT GROUP_SIZE SEED

Token ids lie inside the tiny model's vocabulary and rewards differ within each group (so GRPO steps
change the weights). Prints `DONE` once the buffer acknowledged all of them.
"""

from __future__ import annotations

import sys

from slime_async.train.synthetic import make_trajectories
from slime_async.transport import SyncSender


def main(endpoint: str, count: int, group_size: int, seed: int) -> None:
    with SyncSender(endpoint, name=f"feed-{seed}") as sender:
        for t in make_trajectories(count, group_size=group_size, seed=seed, vocab=500):
            sender.send(t)
        sender.flush()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
