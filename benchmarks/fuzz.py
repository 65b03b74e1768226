"""Hostile input at scale: the engine's HTTP routes and the buffer's wire, each with a crash count.

HTTP: hypothesis draws (route, body) pairs (`slime_async.engine.fuzz`: near-valid bodies with hostile
values, arbitrary JSON, bytes that are not JSON) against an embedded engine process on the tiny
model; a crash is a 5xx other than 501/503, or a loop that stops. After the run the engine is brought
back and must serve a greedy request exactly as HF's model does.

Wire: real trajectory frames, damaged (`slime_async.transport.fuzz.mutate`), random bytes, and
well-typed frames with values no episode produces, sent by a raw ZeroMQ peer to a real buffer server;
every frame is acked or nacked with a reason, the server never stops, and every frame it acked
decodes and passes `check_values` on the sender's side too (nothing invalid was stored).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import numpy as np

from benchmarks import Result

DESCRIPTION = "hostile input: hypothesis-fuzzed engine routes and 100k damaged buffer frames (goal: 0 crashes)"


def _http(examples: int) -> tuple[Counter, int, bool, float]:
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from transformers import AutoModelForCausalLM

    from slime_async.engine.fuzz import ADMIN_ROUTES, ALLOWED, call, request_bodies
    from slime_async.launch.process import start_engine
    from slime_async.train.tiny_model import cached_model_dir

    model_dir = cached_model_dir("tiny")
    server = start_engine(model_dir, "--max-batch-size", "4", "--context-length", "256")
    url = server.url
    statuses: Counter = Counter()
    crashes = [0]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data: st.DataObject) -> None:
        route, body = data.draw(request_bodies())
        status, _ = call(url, route, body)
        statuses[(route, status)] += 1
        crashes[0] += status not in ALLOWED[route]
        if route in ADMIN_ROUTES:
            call(url, "/resume_memory_occupation", b"{}")
            call(url, "/continue_generation", b"{}")
        crashes[0] += "loop has stopped" in call(url, "/health", None)[1]

    start = time.perf_counter()
    try:
        one()
        seconds = time.perf_counter() - start
        weights = {"model_path": str(model_dir), "weight_version": "0"}
        call(url, "/update_weights_from_disk", json.dumps(weights).encode())
        status, text = call(url, "/generate", json.dumps({"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0.0}}).encode())
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 3:].tolist()
        serves = status == 200 and json.loads(text)["output_ids"] == expected
    finally:
        server.stop()
    return statuses, crashes[0], serves, seconds


def _wire(frames: int) -> tuple[Counter, int, bool, float]:
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
    rng = np.random.default_rng(20261205)
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
    return answers, stored_invalid, alive, seconds


def run(quick: bool = False) -> Result:
    examples, frames = (300, 20_000) if quick else (3_000, 100_000)
    statuses, http_crashes, serves, http_s = _http(examples)
    answers, stored_invalid, alive, wire_s = _wire(frames)
    rows: list[list] = []
    by_status: Counter = Counter()
    for (_, status), n in statuses.items():
        by_status[status] += n
    for status, n in sorted(by_status.items()):
        rows.append(["engine HTTP", f"status {status}", n])
    rows.append(["engine HTTP", "crashes (5xx but 501/503, or a dead loop)", http_crashes])
    rows.append(["engine HTTP", "serves exactly after the run", serves])
    for outcome, n in sorted(answers.items()):
        rows.append(["buffer wire", outcome, n])
    rows.append(["buffer wire", "acked but invalid", stored_invalid])
    rows.append(["buffer wire", "server alive after the run", alive])
    crashes = http_crashes + stored_invalid + (not alive) + (not serves)
    headline = (f"fuzz: {sum(statuses.values()):,} engine requests and {frames:,} buffer frames tried, "
                f"crashes {crashes} (goal 0); rejects by reason in the table")
    return Result(columns=["target", "outcome", "count"], rows=rows, headline=headline, details={
        "http_examples": examples, "http_seconds": http_s, "wire_frames": frames, "wire_seconds": wire_s,
        "statuses": {f"{r} {s}": n for (r, s), n in sorted(statuses.items())}})
