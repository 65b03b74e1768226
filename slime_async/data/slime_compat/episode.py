"""What a slime function calls while its episode runs: `post` (slime's `http_utils.post`) and
`GenerateState` (slime's `sglang_rollout.GenerateState`), both bound to the running episode.

slime's signature gives no place to pass the episode, so it travels in a context variable: each
episode runs in its own asyncio task whose context holds its `_Record` (model calls made, tokenizer,
policy). Concurrent episodes never see each other's.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slime_async.env import Policy, Sampling


@dataclass
class _Call:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class _Record:
    policy: Policy
    tokenizer: Any
    shared: dict[str, Any] = field(default_factory=dict)
    """The factory's state across its episodes (one GenerateState, as slime has one per process)."""
    calls: list[_Call] = field(default_factory=list)


_EPISODE: contextvars.ContextVar[_Record] = contextvars.ContextVar("slime_compat_episode")

_FORMAT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params"}
"""Sampling keys about text formatting that `post` applies itself (they change no token)."""


def _current(what: str) -> _Record:
    record = _EPISODE.get(None)
    if record is None:
        raise RuntimeError(
            f"slime_compat.{what} is only for functions run by SlimeGenerateFactory "
            "(env.name: slime_async.data.slime_compat:SlimeGenerate)"
        )
    return record


class GenerateState:
    """slime's per-process generation state: `tokenizer` (the run's, from `model.path`), `processor`
    (None: no multimodal), `sampling_params` (from the rollout flags in `args`), `semaphore`.
    `GenerateState(args)` returns the same object for every episode of one adapter, as slime's
    singleton does."""

    tokenizer: Any
    processor: Any
    sampling_params: dict[str, Any]
    semaphore: asyncio.Semaphore
    args: Any

    def __new__(cls, args: Any) -> GenerateState:
        record = _current("GenerateState")
        state = record.shared.get("generate_state")
        if state is None:
            state = super().__new__(cls)
            state.args = args
            state.tokenizer = record.tokenizer
            state.processor = None
            state.sampling_params = slime_sampling_params(args)
            state.semaphore = asyncio.Semaphore(int(getattr(args, "sglang_server_concurrency", 512) or 512))
            record.shared["generate_state"] = state
        return state

    def __init__(self, args: Any) -> None:
        """Nothing to do: `__new__` returned the adapter's one state."""


def slime_sampling_params(args: Any) -> dict[str, Any]:
    """The `sampling_params` slime hands a generate function, from the rollout flags in `args`."""
    return {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


async def post(
    url: str,
    payload: dict[str, Any],
    max_retries: int = 60,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Drop-in for `slime.utils.http_utils.post` inside an adapted episode: `/generate` only, answered
    in SGLang's shape (`text`, `output_ids`, `meta_info.output_token_logprobs`, `finish_reason`,
    `weight_version`). Retries and routing belong to the scheduler's client, so `max_retries` and
    `headers` are not used."""
    record = _current("post")
    if not url.rstrip("/").endswith("/generate"):
        raise ValueError(f"slime_compat.post: only /generate is routed, not {url}")
    params = {k: v for k, v in (payload.get("sampling_params") or {}).items() if v is not None}
    if payload.get("input_ids") is not None:
        input_ids = [int(t) for t in payload["input_ids"]]
    elif isinstance(payload.get("text"), str):
        input_ids = record.tokenizer.encode(payload["text"])  # with special tokens, as SGLang tokenizes text
    else:
        raise ValueError("slime_compat.post: the payload needs input_ids or text")
    ids, lps, versions, finish = await _generate(record.policy, input_ids, params)
    record.calls.append(_Call(ids, lps, versions))
    skip = bool(params.get("skip_special_tokens", True))
    return {
        "text": record.tokenizer.decode(ids, skip_special_tokens=skip),
        "output_ids": ids,
        "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            "finish_reason": {"type": finish},
            "weight_version": str(max(versions)) if versions else "0",
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        },
    }


async def _generate(
    policy: Policy, input_ids: list[int], params: dict[str, Any]
) -> tuple[list[int], list[float], list[int], str]:
    client = getattr(policy, "client", None)
    if client is not None:  # the scheduler's HttpPolicy: every SGLang sampling key passes through
        gen = await client.generate(
            input_ids, {k: v for k, v in params.items() if k not in _FORMAT_ONLY}, episode=policy.episode
        )  # type: ignore[attr-defined]
        return (
            [int(i) for i in gen.output_ids],
            [float(x) for x in gen.logprobs],
            [int(v) for v in gen.versions],
            gen.finish_reason,
        )
    keys = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop")
    known = {k: params[k] for k in keys if k in params}
    if isinstance(known.get("stop"), str):
        known["stop"] = [known["stop"]]
    out = await policy.generate(np.asarray(input_ids, np.int64), Sampling(**known))
    return (
        [int(i) for i in out.completion_ids],
        [float(x) for x in out.logprobs],
        [int(v) for v in out.versions],
        out.finish_reason,
    )
