"""Fuzzing the frame decoder: mutated real frames and random bytes never crash it.

The only outcomes allowed are a Trajectory (a mutation that still decodes) or `Rejected` with a
reason. Seeded, so a failure reproduces; 120k inputs in roughly 5-15 s on this machine.
"""

from __future__ import annotations

import numpy as np
from transport_helpers import make_trajectory

from slime_async.transport import Rejected, decode_trajectory
from slime_async.types import Trajectory, to_msgpack

N_INPUTS = 120_000


def _mutate(frame: bytes, rng: np.random.Generator) -> bytes:
    data = bytearray(frame)
    op = rng.integers(6)
    if op == 0:  # flip bits
        for _ in range(rng.integers(1, 8)):
            i = rng.integers(len(data))
            data[i] ^= 1 << int(rng.integers(8))
    elif op == 1:  # overwrite bytes
        for _ in range(rng.integers(1, 8)):
            data[rng.integers(len(data))] = rng.integers(256)
    elif op == 2:  # truncate
        del data[rng.integers(len(data)) :]
    elif op == 3:  # insert random bytes
        i = rng.integers(len(data) + 1)
        data[i:i] = rng.integers(0, 256, rng.integers(1, 16), dtype=np.uint8).tobytes()
    elif op == 4:  # delete a span
        i = rng.integers(len(data))
        del data[i : i + rng.integers(1, 16)]
    else:  # splice in the msgpack type bytes that change a length or type (map/array/ext/str headers)
        data[rng.integers(len(data))] = int(rng.choice([0xC4, 0xC7, 0xC8, 0xC9, 0xD4, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF]))
    return bytes(data)


def test_decoder_never_crashes_on_120k_inputs() -> None:
    rng = np.random.default_rng(20261202)
    traj = make_trajectory(0, tokens=12)
    traj.rewards = {"correct": 1.0}
    traj.metrics = {"calls": 2.0}
    seeds = [to_msgpack(traj), to_msgpack(make_trajectory(1, tokens=0)), to_msgpack([traj])]
    outcomes = {"decoded": 0, "rejected": 0}
    reasons: set[str] = set()
    for k in range(N_INPUTS):
        if k % 10 == 0:
            data = rng.integers(0, 256, rng.integers(0, 64), dtype=np.uint8).tobytes()
        else:
            data = _mutate(seeds[k % len(seeds)], rng)
        try:
            result = decode_trajectory(data, max_bytes=1 << 20)
        except Rejected as exc:
            outcomes["rejected"] += 1
            reasons.add(exc.reason.value)
        else:
            assert isinstance(result, Trajectory)
            outcomes["decoded"] += 1
    assert sum(outcomes.values()) == N_INPUTS
    assert outcomes["rejected"] > N_INPUTS // 2 and outcomes["decoded"] > 0, outcomes
    assert {"garbage", "truncated", "invalid"} <= reasons, reasons
