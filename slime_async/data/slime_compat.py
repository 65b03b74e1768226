"""Running a slime custom-generate function inside the scheduler, unchanged but for one import.

slime lets users replace rollout with `async def generate(args, sample, sampling_params) -> Sample`
(`--custom-generate-function-path`), which posts to SGLang's `/generate` with
`slime.utils.http_utils.post` and fills `sample.tokens`, `response`, `response_length`,
`loss_mask`, `rollout_log_probs`, `reward` and `status`. To port one:

1. import `Sample` and `post` from here instead of from slime;
2. `SlimeGenerateFactory(generate, args={...}, reward=custom_rm)` goes where an EnvFactory goes
   (the Scheduler, an EnvRouter).

`post` routes each `/generate` through the scheduler's SGLang client (sticky routing, retries,
failover, resume after a weight-update abort), whatever host the function put in the URL, and
records every generated token with its logprob and weight version. The finished Sample becomes a
Trajectory: the prompt and each loss-mask-0 stretch (tool output, observations) are environment
tokens, each loss-mask-1 stretch a completion whose versions come from that record; slime's
`rollout_log_probs` are kept as the behaviour logprobs. A function that raises, or a Sample whose
lengths disagree, ends that episode with StopReason.ENV_ERROR and a message saying what is wrong.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import importlib
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from slime_async.env import Env, EnvArgs, EnvFactory, Limits, Policy, Sampling
from slime_async.types import StopReason, Task, Trajectory, Turn


@dataclass
class Sample:
    """The fields of slime's `Sample` that generate functions use (`slime/utils/types.py`)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    """Prompt tokens followed by response tokens."""
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    """One per response token: 1 for model tokens to train on, 0 for tool/observation tokens."""
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    """One per response token (0 for tokens the model did not generate)."""
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


GenerateFn = Callable[[Any, Sample, dict[str, Any]], Awaitable[Sample]]
RewardFn = Callable[[Any, Sample], Awaitable[float | dict[str, Any]]]


@dataclass
class _Call:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class _Record:
    policy: Policy
    tokenizer: Any
    calls: list[_Call] = field(default_factory=list)


_EPISODE: contextvars.ContextVar[_Record] = contextvars.ContextVar("slime_compat_episode")
# The running episode of this asyncio task: `post` needs it, and slime's signature gives no place
# to pass it. Each episode is its own asyncio task, so concurrent episodes never see each other's.

_FORMAT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
"""Sampling keys about text formatting that `post` applies itself (they change no token)."""


async def post(url: str, payload: dict[str, Any], max_retries: int = 60, action: str = "post") -> dict[str, Any]:
    """Drop-in for `slime.utils.http_utils.post` inside an adapted episode: `/generate` only, answered
    in SGLang's shape (`text`, `output_ids`, `meta_info.output_token_logprobs`, `finish_reason`,
    `weight_version`). Retries belong to the scheduler's client, so `max_retries` is not used."""
    record = _EPISODE.get(None)
    if record is None:
        raise RuntimeError("slime_compat.post is only for generate functions run by SlimeGenerateFactory")
    if not url.rstrip("/").endswith("/generate"):
        raise ValueError(f"slime_compat.post: only /generate is routed, not {url}")
    params = {k: v for k, v in (payload.get("sampling_params") or {}).items() if v is not None}
    if payload.get("input_ids") is not None:
        input_ids = [int(t) for t in payload["input_ids"]]
    elif isinstance(payload.get("text"), str):
        input_ids = record.tokenizer.encode(payload["text"], add_special_tokens=False)
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


async def _generate(policy: Policy, input_ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float],
                                                                                            list[int], str]:
    client = getattr(policy, "client", None)
    if client is not None:  # the scheduler's HttpPolicy: every SGLang sampling key passes through
        gen = await client.generate(input_ids, {k: v for k, v in params.items() if k not in _FORMAT_ONLY},
                                    episode=policy.episode)  # type: ignore[attr-defined]
        return ([int(i) for i in gen.output_ids], [float(x) for x in gen.logprobs],
                [int(v) for v in gen.versions], gen.finish_reason)
    known = {k: params[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids") if k in params}
    out = await policy.generate(np.asarray(input_ids, np.int64), Sampling(**known))
    return ([int(i) for i in out.completion_ids], [float(x) for x in out.logprobs],
            [int(v) for v in out.versions], out.finish_reason)


class _SlimeEnv(Env):
    """Stands for the generate function where an Env class is expected (it has no group rewards)."""


SLIME_ENV_NAME = "slime_async.data.slime_compat:SlimeGenerate"
"""The `env.name` (or a `data.envs` entry's) that runs a slime generate function, with `SlimeGenerateArgs`."""


class SlimeGenerateArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`env.args` for SLIME_ENV_NAME."""

    generate: str
    """The generate function, `module:function` (or slime's `module.function`)."""
    reward: str | None = None
    """slime's custom reward function `async (args, sample) -> float | dict`; null: the sample's own reward."""
    reward_key: str | None = None
    """When rewards are dicts: the key that trains (slime's --reward-key)."""
    args: dict[str, Any] = {}
    """Extra attributes of the `args` the functions get (slime's flags they read)."""


class SlimeGenerateFactory(EnvFactory):
    """An EnvFactory whose episodes are a slime-style generate function (and optional reward function)."""

    def __init__(self, generate: GenerateFn | str, args: dict[str, Any] | None = None,
                 reward: RewardFn | str | None = None, reward_key: str | None = None, name: str = "") -> None:
        self.generate = load_function(generate) if isinstance(generate, str) else generate
        self.reward_fn = load_function(reward) if isinstance(reward, str) else reward
        self.reward_key = reward_key
        self.extra_args = dict(args or {})
        gen_name = f"{self.generate.__module__}:{getattr(self.generate, '__qualname__', 'generate')}"
        super().__init__(_SlimeEnv, EnvArgs(), name or f"slime:{gen_name}")

    @classmethod
    def from_args(cls, raw: dict[str, Any], name: str = SLIME_ENV_NAME) -> SlimeGenerateFactory:
        """From `env.args` (validated as SlimeGenerateArgs; errors name the field)."""
        try:
            a = msgspec.convert(raw, SlimeGenerateArgs)
        except msgspec.ValidationError as exc:
            raise ValueError(f"env.args of {name}: {exc} (it takes: {', '.join(SlimeGenerateArgs.__struct_fields__)})"
                             ) from None
        return cls(a.generate, args=a.args, reward=a.reward, reward_key=a.reward_key)

    def slime_args(self, policy: Policy, sampling: Sampling) -> types.SimpleNamespace:
        """The `args` the function gets: the given ones, plus where slime's router would be and the
        rollout flags it commonly reads."""
        host, port = "127.0.0.1", 0
        client = getattr(policy, "client", None)
        if client is not None and client.servers:
            from urllib.parse import urlsplit

            parts = urlsplit(next(iter(client.servers)))
            host, port = parts.hostname or host, parts.port or 80
        base = {"sglang_router_ip": host, "sglang_router_port": port,
                "rollout_max_response_len": sampling.max_new_tokens, "rollout_temperature": sampling.temperature,
                "rollout_top_p": sampling.top_p, "rollout_top_k": sampling.top_k, "reward_key": self.reward_key}
        return types.SimpleNamespace(**{**base, **self.extra_args})

    async def episode(self, task: Task, policy: Policy, tokenizer: Any, *, limits: Limits | None = None,
                      sampling: Sampling | None = None, stop: asyncio.Event | None = None, group_id: str = "",
                      sample_index: int = 0, **_: Any) -> Trajectory:
        sampling = sampling or Sampling()
        limits = limits or Limits()
        prompt = task.prompt if isinstance(task.prompt, str) else [m.to_chat() for m in task.prompt]
        sample = Sample(index=sample_index, prompt=prompt, label=task.answer, metadata=dict(task.metadata))
        args = self.slime_args(policy, sampling)
        record = _Record(policy, tokenizer)
        t0 = time.monotonic()
        reason, error = await self._run(args, sample, sampling, record, limits, stop)
        timings = {"episode": time.monotonic() - t0}
        turns: list[Turn] = []
        rewards: dict[str, float] = {}
        reward = 0.0
        if reason not in (StopReason.ENV_ERROR, StopReason.SERVER_ERROR, StopReason.ABORTED):
            try:
                turns = to_turns(sample, record.calls)
                rewards, reward = await self._reward(args, sample)
            except (ValueError, TypeError, KeyError) as exc:
                reason, error = StopReason.ENV_ERROR, f"{type(exc).__name__}: {exc}"
        return Trajectory(
            task_id=task.id, group_id=group_id or task.id, sample_index=sample_index, turns=turns,
            stop_reason=reason, rewards=rewards, reward=reward, timings=timings, env=self.name, error=error,
            metrics={"turns": float(len(turns)), "model_calls": float(len(record.calls)),
                     "completion_tokens": float(sum(len(t.completion_ids) for t in turns))},
        )

    async def _run(self, args: Any, sample: Sample, sampling: Sampling, record: _Record, limits: Limits,
                   stop: asyncio.Event | None) -> tuple[StopReason, str]:
        # The function runs in its own task whose context holds this episode's record (for `post`).
        ctx = contextvars.copy_context()
        ctx.run(_EPISODE.set, record)
        job = asyncio.get_running_loop().create_task(self.generate(args, sample, sampling.to_sglang()), context=ctx)
        waiters: set[asyncio.Future[Any]] = {job}
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        if stopper is not None:
            waiters.add(stopper)
        try:
            done, _ = await asyncio.wait(waiters, timeout=limits.episode_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in waiters:
                if not f.done():
                    f.cancel()
        if job not in done:
            await asyncio.gather(job, return_exceptions=True)
            if stopper is not None and stopper in done:
                return StopReason.ABORTED, "stopped by the caller"
            return StopReason.EPISODE_TIMEOUT, ""
        exc = job.exception()
        if exc is not None:
            from slime_async.rollout.client import ServerError

            kind = StopReason.SERVER_ERROR if isinstance(exc, ServerError) else StopReason.ENV_ERROR
            return kind, f"generate function raised {type(exc).__name__}: {exc}"
        status = sample.status
        return {Sample.Status.TRUNCATED: StopReason.TRUNCATED, Sample.Status.ABORTED: StopReason.ABORTED,
                Sample.Status.FAILED: StopReason.ENV_ERROR}.get(status, StopReason.DONE), (
            "the generate function marked the sample FAILED" if status == Sample.Status.FAILED else "")

    async def _reward(self, args: Any, sample: Sample) -> tuple[dict[str, float], float]:
        value = sample.reward
        if value is None and self.reward_fn is not None:
            value = await self.reward_fn(args, sample)
            sample.reward = value
        if value is None:
            raise ValueError("the sample has no reward: set sample.reward in generate, or give a reward function")
        if isinstance(value, dict):
            if self.reward_key is None or self.reward_key not in value:
                raise KeyError(f"reward is a dict {sorted(value)}: set reward_key to the one that trains")
            rewards = {k: float(v) for k, v in value.items() if isinstance(v, int | float)}
            return rewards, float(value[self.reward_key])
        return {"reward": float(value)}, float(value)


def to_turns(sample: Sample, calls: list[_Call]) -> list[Turn]:
    """Split a finished Sample into Turns: environment tokens (the prompt, loss-mask-0 stretches)
    then model tokens (loss-mask-1 stretches). Versions come from the recorded model calls, matched
    token by token in order; a token not found there gets the oldest recorded version (staleness is
    then overestimated, never under)."""
    n = sample.response_length
    if n <= 0 or n > len(sample.tokens):
        raise ValueError(f"response_length {n} does not fit tokens ({len(sample.tokens)})")
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if len(mask) != n:
        raise ValueError(f"loss_mask has {len(mask)} entries, response_length is {n}")
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != n:
        raise ValueError(f"rollout_log_probs has {len(sample.rollout_log_probs)} entries, response_length is {n}")
    generated = [(t, lp, v) for c in calls for t, lp, v in zip(c.output_ids, c.logprobs, c.versions, strict=True)]
    oldest = min((v for _, _, v in generated), default=min((int(v) for v in sample.weight_versions), default=0))
    response = sample.tokens[-n:]
    turns: list[Turn] = []
    env_ids: list[int] = list(sample.tokens[:-n])
    pos = 0  # position in `generated`
    i = 0
    while i < n:
        if not mask[i]:
            env_ids.append(response[i])
            i += 1
            continue
        ids, lps, vs = [], [], []
        while i < n and mask[i]:
            tok = response[i]
            j = pos
            while j < len(generated) and generated[j][0] != tok:
                j += 1
            if j < len(generated):
                lp, v, pos = generated[j][1], generated[j][2], j + 1
            else:
                lp, v = 0.0, oldest
            ids.append(tok)
            lps.append(sample.rollout_log_probs[i] if sample.rollout_log_probs is not None else lp)
            vs.append(v)
            i += 1
        turns.append(Turn(prompt_ids=env_ids, completion_ids=ids, logprobs=lps, versions=vs))
        env_ids = []
    if not turns:
        raise ValueError("the sample has no loss-mask-1 token: nothing to train on")
    return turns


def load_function(path: str) -> Callable[..., Any]:
    """Import `module:function` (slime's `--custom-generate-function-path` uses `module.function`; both work)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"function path {path!r} is not 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn
