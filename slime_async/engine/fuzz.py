"""Hostile request bodies for the engine's HTTP routes, as hypothesis strategies.

Used by `tests/engine/test_fuzz_http.py` (a bounded run in CI) and `slime-async bench fuzz` (many
more). Needs hypothesis (the `dev` extra). Each draw is a route and a body: mostly the route's own
field names with hostile values (NaN, infinities, huge, negative and tiny numbers, wrong types,
unknown fields), sometimes arbitrary JSON or bytes that are not JSON at all.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hypothesis import strategies as st

GENERATE = "/generate"
ADMIN_ROUTES = ("/abort_request", "/flush_cache", "/pause_generation", "/continue_generation",
                "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
                "/release_memory_occupation", "/resume_memory_occupation", "/init_weights_update_group",
                "/update_weights_from_distributed")
_OK = frozenset({200, 400, 401, 403, 404, 405, 413, 415, 501, 503})
ALLOWED: dict[str, frozenset[int]] = {route: _OK for route in (GENERATE, *ADMIN_ROUTES)}
"""What each route may answer a hostile body: anything but a 500 (or another 5xx than 501/503)."""

_NUMBERS = st.sampled_from([0, 1, -1, 2, 255, 2**31, -(2**31), 2**63, 2**64 - 1, 2**70, -(2**70), 1e-45, 1e-7,
                            0.5, 1.0, -0.0, 1e308, float("nan"), float("inf"), float("-inf")])
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
    st.text(max_size=12), inner, max_size=6), max_leaves=24)

_SAMPLING_FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                    "ignore_eos", "n", "sampling_seed", "skip_special_tokens", "no_stop_trim"]
_REFUSED_FIELDS = ["min_new_tokens", "frequency_penalty", "regex", "logit_bias", "temprature"]
_FIELDS: dict[str, list[str]] = {
    "/abort_request": ["rid", "abort_all"],
    "/pause_generation": ["mode"],
    "/continue_generation": ["torch_empty_cache"],
    "/flush_cache": [],
    "/update_weights_from_disk": ["model_path", "load_format", "weight_version", "flush_cache", "keep_pause",
                                  "abort_all_requests"],
    "/update_weights_from_tensor": ["serialized_named_tensors", "weight_version", "flush_cache", "load_format"],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/release_memory_occupation": ["tags"],
    "/resume_memory_occupation": ["tags"],
    "/init_weights_update_group": ["master_address", "master_port", "rank_offset", "world_size", "backend"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes", "weight_version"],
}
_MEANINGFUL = {  # values that get past the schema, so the handlers behind it are reached too
    "mode": st.sampled_from(["abort", "retract", "in_place", "sideways"]),
    "tags": st.lists(st.sampled_from(["kv_cache", "weights", "cuda_graph", "x"]), max_size=3),
    "new_version": st.sampled_from(["1", "0", "-3", "pending", "", "9" * 40]),
    "weight_version": st.sampled_from(["2", "pending", "", None]),
    "model_path": st.sampled_from(["/", "/etc/shadow", "/nonexistent", "", "." * 4000, "/proc/self/mem"]),
    "serialized_named_tensors": st.lists(st.sampled_from(["", "%%%", "gAR9lC4=", "gASVBQAAAAAAAABLAS4=",
                                                          "AAAAAAAAAAB7fQ=="]), max_size=3),
    # sampling: mostly in range (the request is served: the sampler meets the value), else hostile
    "max_new_tokens": st.integers(0, 24) | _NUMBERS,
    "temperature": st.floats(0, 4) | st.floats(0, 1e-5) | _NUMBERS,
    "top_p": st.floats(1e-6, 1) | _NUMBERS,
    "top_k": st.integers(-1, 2000) | _NUMBERS,
    "min_p": st.floats(0, 1) | _NUMBERS,
    "n": st.integers(1, 4) | _NUMBERS,
    "sampling_seed": st.integers(0, 2**64 - 1) | _NUMBERS,
    "stop_token_ids": st.lists(st.integers(0, 900), max_size=4) | _JSON,
    "stop": st.lists(st.text(max_size=4), max_size=3) | st.text(max_size=4),
    "ignore_eos": st.booleans(),
}


@st.composite
def _fields(draw: Any, names: list[str]) -> dict[str, Any]:
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names))) if names else []
    return {name: draw(_MEANINGFUL.get(name, _JSON)) for name in chosen}


@st.composite
def _generate_body(draw: Any) -> dict[str, Any]:
    body = draw(_fields(["rid", "text", "return_logprob", "stream"]))
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(_fields(["logprob_start_len", "image_data", "bogus"])))
    if "text" not in body or draw(st.booleans()):
        body["input_ids"] = draw(st.lists(st.integers(0, 800), min_size=1, max_size=30) | st.lists(
            st.integers(0, 800) | _NUMBERS, max_size=30))
    sampling = draw(st.sampled_from(["fields"] * 6 + ["refused", "json", "none"]))
    if sampling == "fields":
        body["sampling_params"] = draw(_fields(_SAMPLING_FIELDS))
    elif sampling == "refused":
        body["sampling_params"] = draw(_fields(_REFUSED_FIELDS))
    elif sampling == "json":
        body["sampling_params"] = draw(_JSON)
    return body


@st.composite
def request_bodies(draw: Any) -> tuple[str, bytes]:
    """A route and a body for it: near-valid (mostly), arbitrary JSON, or not JSON at all."""
    route = draw(st.sampled_from([GENERATE] * len(ADMIN_ROUTES) + list(ADMIN_ROUTES)))
    kind = draw(st.sampled_from(["fields"] * 6 + ["json", "bytes"]))
    if kind == "bytes":
        return route, draw(st.binary(max_size=200))
    body = draw(_JSON) if kind == "json" else (
        draw(_generate_body()) if route == GENERATE else draw(_fields(_FIELDS[route])))
    return route, json.dumps(body).encode()  # NaN and infinities as Python writes them: not JSON


def call(url: str, route: str, body: bytes | None, timeout: float = 60) -> tuple[int, str]:
    """POST `body` as JSON (GET when None) to a server's `route`: the status and the start of the answer."""
    request = urllib.request.Request(url + route, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(2000).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(2000).decode(errors="replace")
