"""Fuzzing the frame decoder: mutated real frames and random bytes never crash it.

The only outcomes allowed are a Trajectory (a mutation that still decodes) or `Rejected` with a
reason. Seeded, so a failure reproduces; 120k inputs in roughly 5-15 s on this machine.
"""

from __future__ import annotations

import numpy as np
from transport_helpers import make_trajectory

from slime_async.transport import Rejected, decode_trajectory
from slime_async.transport.fuzz import mutate
from slime_async.types import Trajectory, to_msgpack

N_INPUTS = 120_000


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
            data = mutate(seeds[k % len(seeds)], rng)
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
