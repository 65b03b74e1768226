"""Mutations of real frames, for fuzzing the buffer's wire (`tests/transport/test_transport_fuzz.py`,
`slime-async bench fuzz`): bit flips, overwrites, truncations, insertions, deletions, and the
msgpack header bytes that change a length or a type."""

from __future__ import annotations

import numpy as np


def mutate(frame: bytes, rng: np.random.Generator) -> bytes:
    """`frame` with one random kind of damage."""
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
