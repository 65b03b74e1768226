"""The rollout client's vLLM dialect: token ids in, token ids + logprobs + weight versions out.

vLLM (0.32, `vllm serve --enable-scale-out`) has a native token-in/token-out route,
`POST /inference/v1/generate {token_ids, sampling_params}`, whose answer carries per choice the
output `token_ids`, the sampled token's `logprobs.content[i].logprob` and `weight_versions` spans
(`[{version, start, end}]`, the version of each token, as SGLang's `meta_info.weight_versions`).
Everything else is the SGLang client's: one session, sticky episodes, retries, failover, abort of
cancelled requests (`/inference/v1/abort_requests`), resume of engine-aborted ones, versions from
`GET /weight_info`.

What vLLM reports differently, normalised here (and pinned by `tests/vllm/test_vllm_client.py`):
- sampling parameters are renamed (`max_new_tokens` -> `max_tokens`, `sampling_seed` -> `seed`);
  one with no vLLM equivalent is refused by name, never dropped;
- logprobs are asked for with `logprobs: 0` (the sampled token only); the launcher starts vLLM with
  `--logprobs-mode processed_logprobs`, so the logprob is `log_softmax(logits / temperature)`, the
  quantity the trainer recomputes (vLLM's default, `raw_logprobs`, ignores the temperature);
- finish reasons `stop`/`length`/`abort` are SGLang's names already; vLLM's `error` is a failed
  request (retried like a 5xx), anything else is a malformed answer;
- the stop token or the token that completed a stop string stays in `token_ids`, as in SGLang.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from slime_async.config.engine_kinds import ADAPTER_NAME, Dialect, engine_kind
from slime_async.rollout.client import BadResponse, SGLangClient
from slime_async.types.arrays import LOGPROB_DTYPE, TOKEN_DTYPE

_GAUGE = re.compile(r"^vllm:num_requests_(?P<what>running|waiting)(?:\{[^}]*\})? (?P<value>\S+)$", re.M)
"""A sample of vLLM's running/waiting gauges in its Prometheus text (`/metrics`)."""
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens",
            "no_stop_trim": "include_stop_str_in_output"}
"""SGLang's name -> vLLM's (`vllm.sampling_params.SamplingParams`)."""
_SAME = frozenset({"temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "skip_special_tokens",
                   "spaces_between_special_tokens", "logit_bias"})


def vllm_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang-named sampling parameters as vLLM's, plus the logprob of each sampled token.

    Raises ValueError naming a parameter that vLLM has no equivalent for (or `n` > 1: the client
    takes one output per request, as with SGLang).
    """
    out: dict[str, Any] = {"logprobs": 0}
    for name, value in params.items():
        if name == "n":
            if value != 1:
                raise ValueError(f"sampling_params.n={value}: the rollout client asks for one output per request")
            continue
        if name in _RENAMED:
            out[_RENAMED[name]] = value
        elif name in _SAME:
            out[name] = value
        else:
            raise ValueError(f"sampling_params.{name}: no vLLM equivalent is known (vLLM takes "
                             f"{sorted(_SAME | set(_RENAMED))})")
    return out


class _Logprob(msgspec.Struct):
    token_id: int
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Span(msgspec.Struct):
    version: str | int
    start: int
    end: int


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    weight_versions: list[_Span] | None = None


class _Answer(msgspec.Struct):
    choices: list[_Choice]


_DECODER = msgspec.json.Decoder(_Answer)
_ENCODER = msgspec.json.Encoder()
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMClient(SGLangClient):
    """`SGLangClient` for vLLM servers: same interface (`generate` takes SGLang's parameter names)."""

    GENERATE = "/inference/v1/generate"
    ABORT = "/inference/v1/abort_requests"
    VERSION = "/weight_info"
    LOAD = "/metrics"
    """vLLM has no `/v1/loads`: its Prometheus gauges `vllm:num_requests_running` and `..._waiting`."""

    def __init__(self, urls: list[str], *, adapter: str | None = None, **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        self.adapter = adapter
        """The LoRA adapter every request asks for by name (a LoRA run: `config.engine_kinds.ADAPTER_NAME`),
        or None for the served model itself."""

    def _parse_load(self, raw: bytes) -> tuple[int, int, int | None]:
        found = {"running": 0.0, "waiting": 0.0}
        seen = set()
        for m in _GAUGE.finditer(raw.decode()):  # one line per engine core / model label set: summed
            found[m["what"]] += float(m["value"])
            seen.add(m["what"])
        if seen != {"running", "waiting"}:
            raise ValueError(f"{self.LOAD}: no vllm:num_requests_{'/'.join(sorted({'running', 'waiting'} - seen))}")
        return int(found["running"]), int(found["waiting"]), None  # its max_num_seqs is not among its metrics

    def _body(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
              routed_from: int | None = None) -> bytes:
        if routed_from is not None:  # the worker turns replay off for vLLM engines; never sent
            raise ValueError("train.moe.routing_replay: vLLM does not report routed experts")
        body = {"token_ids": input_ids, "sampling_params": vllm_sampling(sampling_params), "request_id": rid,
                "output_mode": "tokens"}
        if self.adapter is not None:  # base + the trained adapter (vLLM picks a LoRA by its name as the model)
            body["model"] = self.adapter
        return _ENCODER.encode(body)

    def _abort_body(self, rid: str) -> dict[str, Any]:
        # vLLM serves the request as `generate-tokens-<request_id>` and aborts by that name only
        # (the bare id answers 200 and aborts nothing)
        return {"request_ids": [f"generate-tokens-{rid}"]}

    def _parse(self, raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray | None]:
        try:
            answer = _DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            raise BadResponse(f"malformed {self.GENERATE} response ({exc})") from None
        except msgspec.DecodeError as exc:
            raise BadResponse(f"not JSON ({exc})") from None
        if len(answer.choices) != 1:
            raise BadResponse(f"{len(answer.choices)} choices for one request")
        choice = answer.choices[0]
        if choice.finish_reason == "error":
            raise BadResponse("vLLM answered finish_reason 'error' (the request failed in the engine)")
        finish = _FINISH.get(choice.finish_reason or "")
        if finish is None:
            raise BadResponse(f"unknown finish_reason {choice.finish_reason!r}")
        tokens = choice.token_ids or []
        content = (choice.logprobs.content if choice.logprobs is not None else None) or []
        n = len(tokens)
        if len(content) != n:
            raise BadResponse(f"{n} output tokens but {len(content)} logprobs")
        if any(c.token_id != t for c, t in zip(content, tokens, strict=True)):
            raise BadResponse("the logprobs are not of the sampled tokens")
        if choice.weight_versions is None:
            raise BadResponse("no weight_versions in the answer (is this vLLM >= 0.32?)")
        try:
            ids = np.array(tokens, TOKEN_DTYPE)
        except OverflowError:
            raise BadResponse("token_ids: a token id outside int32") from None
        lps = np.fromiter((c.logprob for c in content), LOGPROB_DTYPE, n)
        return ids, lps, self._versions(choice.weight_versions, n), finish, None


CLIENTS: dict[Dialect, type[SGLangClient]] = {"sglang": SGLangClient, "vllm": VLLMClient}
"""The rollout client of each HTTP dialect (`config.engine_kinds.EngineKind.dialect`)."""


def engine_client(kind: str, urls: list[str], *, lora: bool = False, **kwargs: Any) -> SGLangClient:
    """The rollout client for `engine.kind` (`embedded` and `sglang` speak SGLang's API). `lora`: a
    LoRA run (`train.lora`); where the engines load the adapters themselves, requests ask for them."""
    found = engine_kind(kind)
    if lora and found.lora_adapters:
        kwargs["adapter"] = ADAPTER_NAME
    return CLIENTS[found.dialect](urls, **kwargs)
