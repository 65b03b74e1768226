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
import time
from collections import Counter

from benchmarks import Result

DESCRIPTION = "hostile input: hypothesis-fuzzed engine routes and 100k damaged buffer frames (goal: 0 crashes)"


def _http(examples: int) -> tuple[Counter, int, bool, float]:
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from transformers import AutoModelForCausalLM

    from slime_async.engine.fuzz import ADMIN_ROUTES, ALLOWED, call, request_bodies
    from slime_async.launch.process import start_engine
    from slime_async.models.tiny_model import cached_model_dir

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


def run(quick: bool = False) -> Result:
    examples, frames = (300, 20_000) if quick else (3_000, 100_000)
    statuses, http_crashes, serves, http_s = _http(examples)
    from slime_async.buffer.fuzz import fuzz_wire

    wire = fuzz_wire(frames)
    answers, stored_invalid, alive, wire_s = wire.answers, wire.stored_invalid, wire.alive, wire.seconds
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
