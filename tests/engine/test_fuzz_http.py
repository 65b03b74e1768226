"""Property-based fuzzing (hypothesis) of `/generate` and every admin route of a real engine process.

Bodies are drawn from near-valid requests (the right field names with hostile values: NaN, huge and
negative numbers, wrong types, unknown fields) and from arbitrary JSON. Whatever arrives, the answer
is a status the route documents, never a 500, and the loop never dies; after the run the engine is
brought back (resume, continue, version, its own weights) and serves a normal request exactly.
Derandomized, so a failure reproduces; `slime-async bench fuzz` runs the same with many more examples.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_async.engine.fuzz import ADMIN_ROUTES, ALLOWED, call, request_bodies
from slime_async.launch.process import ChildProcess, start_engine

EXAMPLES = 250


@pytest.fixture(scope="module")
def fuzzed_engine(varied_model_dir: Path) -> Iterator[ChildProcess]:
    # its own engine: the fuzz pauses it, renames its version and releases its memory
    server = start_engine(varied_model_dir, "--max-batch-size", "4", "--context-length", "256")
    yield server
    server.stop()


def test_no_request_gets_a_500_or_stops_the_engine(fuzzed_engine: ChildProcess, reference: torch.nn.Module,
                                                   varied_model_dir: Path) -> None:
    url = fuzzed_engine.url
    seen: Counter[tuple[str, int]] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data: st.DataObject) -> None:
        route, body = data.draw(request_bodies())
        status, text = call(url, route, body)
        seen[(route, status)] += 1
        assert status in ALLOWED[route], (route, body[:300], status, text)
        if route in ADMIN_ROUTES:  # a pause or a release holds every /generate until undone: undo them
            call(url, "/resume_memory_occupation", b"{}")
            call(url, "/continue_generation", b"{}")
        health, text = call(url, "/health", None)
        assert "loop has stopped" not in text and health in (200, 503), (route, body[:300], health, text)

    one()
    assert sum(n for (route, _), n in seen.items() if route == "/generate") > EXAMPLES // 4
    # bring it back: memory, generation, its own weights and version; then it serves exactly
    for route, body in (("/resume_memory_occupation", {}), ("/continue_generation", {}),
                        ("/update_weights_from_disk", {"model_path": str(varied_model_dir), "weight_version": "0"})):
        status, text = call(url, route, json.dumps(body).encode())
        assert status == 200, (route, text)
    status, text = call(url, "/generate", json.dumps({"input_ids": PROMPTS[1], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0}}).encode())
    assert status == 200 and json.loads(text)["output_ids"] == hf_greedy(reference, PROMPTS[1], 8), text
