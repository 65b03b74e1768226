"""Fuzzing the buffer's wire over a real socket: damaged real frames, random bytes and well-typed
frames with values no episode produces, from a raw ZeroMQ peer to a real `BufferServer`.

Every frame is acked or nacked with a reason, the server never stops, and every frame it acked
decodes and passes `check_values` on the sender's side too (nothing invalid was stored). Used by
`tests/transport/test_wire_fuzz.py` (a bounded share, in CI) and `slime-async bench fuzz` (100,000).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np


@dataclass
class WireFuzz:
    answers: Counter
    """`ack`, `nack <reason>` and `stored` (what the server kept, duplicates once)."""
    stored_invalid: int
    """Acked frames that do not decode or fail `check_values`: must be 0."""
    alive: bool
    """The server still runs after the last frame."""
    seconds: float


def fuzz_wire(frames: int, seed: int = 20261205) -> WireFuzz:
    """Send `frames` hostile frames to a buffer server of this process (a thread); what happened."""
    import msgspec
    import zmq

    from slime_async.buffer import BufferServer, ServerSettings
    from slime_async.config.schema import BufferConfig
    from slime_async.transport import Rejected, check_values, decode_trajectory
    from slime_async.transport import protocol as p
    from slime_async.transport.fuzz import mutate
    from slime_async.types import StopReason, Trajectory, Turn, to_msgpack

    def trajectory(k: int, tokens: int = 12) -> Trajectory:
        turn = Turn(prompt_ids=np.arange(4), completion_ids=np.arange(tokens),
                    logprobs=np.full(tokens, -0.5, np.float32), versions=np.zeros(tokens, np.int32))
        return Trajectory(id=f"t{k}", task_id="task", group_id=f"g{k}", sample_index=0, stop_reason=StopReason.DONE,
                          rewards={"correct": 1.0}, turns=[turn])

    bad_values = []
    for field, value in (("logprobs", np.nan), ("logprobs", 3.0), ("completion_ids", -5), ("versions", -1)):
        t = trajectory(90)
        array = getattr(t.turns[0], field).copy()
        array[2] = value
        setattr(t.turns[0], field, array)
        bad_values.append(to_msgpack(t))
    seeds = [to_msgpack(trajectory(0)), to_msgpack(trajectory(1, tokens=0))]
    cfg = BufferConfig(endpoint="tcp://127.0.0.1:0", capacity=10**9, sender_credits=10**9, max_frame_bytes=1 << 16)
    server = BufferServer(ServerSettings(buffer=cfg, group_size=1, max_staleness=10**6))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart([p.HELLO, p.pack_u64(1), p.encode(p.Hello(sender="fuzz"))])
    rng = np.random.default_rng(seed)
    answers: Counter = Counter()
    stored_invalid = 0
    sent: dict[int, bytes] = {}
    start = time.perf_counter()
    try:
        for base in range(0, frames, 200):
            batch = []
            for k in range(base, min(frames, base + 200)):
                if k % 10 == 0:
                    data = rng.integers(0, 256, rng.integers(0, 64), dtype=np.uint8).tobytes()
                elif k % 10 == 1:
                    data = bad_values[k // 10 % len(bad_values)]
                elif k % 10 == 2:  # a good one with a fresh id, so that it is stored, not a duplicate
                    data = to_msgpack(trajectory(k))
                else:
                    data = mutate(seeds[k % len(seeds)], rng)
                batch.append(data)
                sent[k] = data
            seqs = list(range(base, base + len(batch)))
            sock.send_multipart([p.DATA, p.pack_u64(1), p.pack_seqs(seqs), *batch])
            pending = set(seqs)
            while pending:
                if not sock.poll(30_000):
                    raise RuntimeError(f"the buffer stopped answering ({len(pending)} frames unanswered)")
                msg = sock.recv_multipart()
                if msg[0] == p.ACK:
                    for seq in msgspec.msgpack.decode(msg[1], type=p.Ack).seqs:
                        if seq in pending:
                            pending.discard(seq)
                            answers["ack"] += 1
                            try:  # what it stored must be valid: decode it as the trainer would
                                stored_invalid += check_values(decode_trajectory(sent[seq], 1 << 16)) is not None
                            except Rejected:
                                stored_invalid += 1
                elif msg[0] == p.NACK:
                    seq = p.unpack_u64(msg[1], "seq")
                    if seq in pending:
                        pending.discard(seq)
                        answers["nack " + msg[2].decode().split(":")[0]] += 1
            for seq in seqs:
                sent.pop(seq, None)
        seconds = time.perf_counter() - start
        alive = thread.is_alive()
        metrics = server.metrics()
    finally:
        stop.set()
        thread.join(10)
        sock.close(linger=0)
        server.close()
    answers["stored"] = metrics["received"]
    return WireFuzz(answers, stored_invalid, alive, seconds)
