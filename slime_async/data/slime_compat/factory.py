"""SlimeGenerateFactory: a slime custom generate function where an EnvFactory goes.

Per episode: a `Sample` from the task (the chat template applied as slime's `--apply-chat-template`
does), the function run in its own task with `post`/`GenerateState` bound to the episode, the returned
Sample (or list of Samples) checked and split into turns, rewards as slime computes them, one
Trajectory. A list becomes one trajectory whose samples are separate sequences (`Turn.new_branch`),
trained on one reward (`list_reward` says how the samples' rewards combine). With `group_rm` the
reward function scores the whole group at once, as a group reward.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import time
import types
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from slime_async.data.slime_compat.episode import _EPISODE, _Record, slime_sampling_params
from slime_async.data.slime_compat.loading import load_function
from slime_async.data.slime_compat.rm_hub import async_rm, batched_async_rm
from slime_async.data.slime_compat.sample import Sample
from slime_async.data.slime_compat.turns import to_turns
from slime_async.env import Env, EnvArgs, EnvFactory, EnvLoadError, Limits, Policy, Sampling, group_reward
from slime_async.env.policy import ServerError
from slime_async.types import StopReason, Task, Trajectory, Turn

log = logging.getLogger(__name__)

GenerateFn = Callable[..., Awaitable[Any]]
RewardFn = Callable[..., Awaitable[Any]]

SLIME_ENV_NAME = "slime_async.data.slime_compat:SlimeGenerate"
"""The `env.name` (or a `data.envs` entry's) that runs a slime generate function, with `SlimeGenerateArgs`."""

_REMEMBERED = 4096
"""Groups whose index (and, with group_rm, samples) an adapter remembers: far more than are in flight."""


class SlimeGenerateArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`env.args` for SLIME_ENV_NAME: slime's rollout and reward flags that a generate function depends on."""

    generate: str
    """The generate function, `module:function` or slime's `module.function` (--custom-generate-function-path)."""
    reward: str | None = None
    """The reward function `async (args, sample) -> float | dict` (--custom-rm-path); null: the sample's own
    reward, else `rm_type`."""
    rm_type: str | None = None
    """A rule-based reward (--rm-type): math, f1, deepscaler, dapo, optionally boxed_ before it."""
    reward_key: str | None = None
    """When rewards are dicts: the key that trains (--reward-key; in an eval suite's env, --eval-reward-key)."""
    group_rm: bool = False
    """Score each finished group at once: the reward function gets the list of all its samples (--group-rm)."""
    list_reward: Literal["mean", "min", "max", "last"] = "mean"
    """How the rewards of the samples of a returned list combine into the trajectory's one reward."""
    apply_chat_template: bool = False
    """Render the prompt with the model's chat template before the function sees it (--apply-chat-template);
    a text prompt becomes one user message."""
    apply_chat_template_kwargs: dict[str, Any] = {}
    """Extra keyword arguments of the template (--apply-chat-template-kwargs), e.g. `{enable_thinking: false}`."""
    tool_key: str = "tools"
    """Key in the task's metadata of the tool schemas passed to the template (--tool-key)."""
    stop: list[str] | None = None
    """Stop strings in the function's sampling_params (--rollout-stop)."""
    stop_token_ids: list[int] | None = None
    """Stop token ids in the function's sampling_params (--rollout-stop-token-ids)."""
    skip_special_tokens: bool = False
    """Decode `text` without special tokens (--rollout-skip-special-tokens)."""
    max_context_len: int | None = None
    """`args.rollout_max_context_len` (--rollout-max-context-len); null as in slime."""
    evaluation: bool = False
    """Pass `evaluation=True` to functions that take it (set it in an eval suite's env)."""
    args: dict[str, Any] = {}
    """Other attributes of the `args` the functions read (custom flags, `max_tokens_per_gpu`, ...)."""


class _SlimeEnv(Env):
    """Stands for the generate function where an Env class is expected (no group rewards)."""


class SlimeGenerateFactory(EnvFactory):
    """An EnvFactory whose episodes are a slime-style generate function (and optional reward function)."""

    def __init__(
        self,
        generate: GenerateFn | str,
        args: dict[str, Any] | None = None,
        reward: RewardFn | str | None = None,
        reward_key: str | None = None,
        name: str = "",
        **options: Any,
    ) -> None:
        """`options`: the other fields of SlimeGenerateArgs (rm_type, group_rm, apply_chat_template, ...)."""
        self.generate_path = generate if isinstance(generate, str) else None
        self.generate = load_function(generate, "env.args.generate") if isinstance(generate, str) else generate
        self.reward_fn = load_function(reward, "env.args.reward") if isinstance(reward, str) else reward
        self.reward_path = reward if isinstance(reward, str) else None
        try:
            self.options = msgspec.convert(
                {"generate": self.generate_path or "", "reward_key": reward_key, **options}, SlimeGenerateArgs
            )
        except msgspec.ValidationError as exc:
            raise EnvLoadError(f"SlimeGenerateFactory: {exc}") from None
        self.reward_key = reward_key
        self.extra_args = dict(args or {})
        self._takes_evaluation = "evaluation" in inspect.signature(self.generate).parameters
        self._groups: OrderedDict[str, int] = OrderedDict()
        self._group_count = itertools.count()
        self._episodes = itertools.count()
        self._shared: dict[str, Any] = {}
        self._pending: OrderedDict[str, tuple[Any, list[Sample]]] = OrderedDict()
        self._errors_seen: set[str] = set()
        env_cls = _SlimeEnv
        if self.options.group_rm:
            env_cls = type("SlimeGroupRM", (_SlimeEnv,), {"group_rm": group_reward(self._group_rm_fn())})
        gen_name = f"{self.generate.__module__}:{getattr(self.generate, '__qualname__', 'generate')}"
        super().__init__(env_cls, EnvArgs(), name or f"slime:{gen_name}")

    @classmethod
    def from_args(cls, raw: dict[str, Any], name: str = SLIME_ENV_NAME) -> SlimeGenerateFactory:
        """From `env.args` (validated as SlimeGenerateArgs; errors name the field)."""
        try:
            a = msgspec.convert(raw, SlimeGenerateArgs)
        except msgspec.ValidationError as exc:
            raise EnvLoadError(
                f"env.args of {name}: {exc} (it takes: {', '.join(SlimeGenerateArgs.__struct_fields__)})"
            ) from None
        named = ("generate", "reward", "reward_key", "args")
        options = {f: getattr(a, f) for f in a.__struct_fields__ if f not in named}
        return cls(a.generate, args=a.args, reward=a.reward, reward_key=a.reward_key, **options)

    def slime_args(self, policy: Policy, sampling: Sampling, tokenizer: Any = None) -> types.SimpleNamespace:
        """The `args` the functions get: slime's flags that generate and reward functions read, filled
        from this run (the router address, `hf_checkpoint` = the model directory the tokenizer came
        from, the rollout sampling flags), then the configured `args`. Fresh per episode: functions may
        set attributes on it (slime's multi-agent example does)."""
        host, port = "127.0.0.1", 0
        client = getattr(policy, "client", None)
        if client is not None and client.servers:
            from urllib.parse import urlsplit

            parts = urlsplit(next(iter(client.servers)))
            host, port = parts.hostname or host, parts.port or 80
        o = self.options
        base = {
            "sglang_router_ip": host,
            "sglang_router_port": port,
            "hf_checkpoint": getattr(tokenizer, "name_or_path", None) or None,
            # The scheduler resumes a request cut by a weight update itself (rollout.partial_mode): the
            # function never gets a half-generated sample back, which is what slime's flag means to it.
            "partial_rollout": False,
            "mask_offpolicy_in_partial_rollout": False,
            "rollout_temperature": sampling.temperature,
            "rollout_top_p": sampling.top_p,
            "rollout_top_k": sampling.top_k,
            "rollout_max_response_len": sampling.max_new_tokens,
            "rollout_stop": o.stop,
            "rollout_stop_token_ids": o.stop_token_ids,
            "rollout_skip_special_tokens": o.skip_special_tokens,
            "rollout_max_context_len": o.max_context_len,
            "eval_max_context_len": o.max_context_len,
            "rollout_max_prompt_len": None,
            "context_parallel_size": 1,
            "max_tokens_per_gpu": None,
            "apply_chat_template": o.apply_chat_template,
            "apply_chat_template_kwargs": dict(o.apply_chat_template_kwargs),
            "custom_generate_function_path": self.generate_path,
            "custom_rm_path": self.reward_path or self.reward_fn,
            "rm_type": o.rm_type,
            "reward_key": self.reward_key,
            "eval_reward_key": self.reward_key,
            "group_rm": o.group_rm,
            "sglang_server_concurrency": 512,
            "sglang_dp_size": None,
            "use_rollout_routing_replay": False,
            "ci_test": False,
        }
        return types.SimpleNamespace(**{**base, **self.extra_args})

    def prompt_of(self, task: Task, tokenizer: Any) -> str | list[dict[str, Any]]:
        """The prompt as slime's dataset makes it: the chat template applied (with the task's tools), or raw."""
        prompt: str | list[dict[str, Any]] = (
            task.prompt if isinstance(task.prompt, str) else [m.to_chat() for m in task.prompt]
        )
        if not self.options.apply_chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(
            messages,
            tools=task.metadata.get(self.options.tool_key),
            tokenize=False,
            add_generation_prompt=True,
            **self.options.apply_chat_template_kwargs,
        )

    def _group_index(self, group_id: str) -> int:
        if group_id not in self._groups:
            self._groups[group_id] = next(self._group_count)
            if len(self._groups) > _REMEMBERED:
                self._groups.popitem(last=False)
        return self._groups[group_id]

    async def episode(
        self,
        task: Task,
        policy: Policy,
        tokenizer: Any,
        *,
        limits: Limits | None = None,
        sampling: Sampling | None = None,
        stop: asyncio.Event | None = None,
        group_id: str = "",
        sample_index: int = 0,
        **_: Any,
    ) -> Trajectory:
        sampling = sampling or Sampling()
        limits = limits or Limits()
        group_id = group_id or task.id
        args = self.slime_args(policy, sampling, tokenizer)
        record = _Record(policy, tokenizer, shared=self._shared)
        t0 = time.monotonic()
        samples: list[Sample] = []
        turns: list[Turn] = []
        rewards: dict[str, float] = {}
        reward = 0.0
        try:
            sample = Sample(
                group_index=self._group_index(group_id),
                index=next(self._episodes),
                prompt=self.prompt_of(task, tokenizer),
                label=task.answer,
                metadata=dict(task.metadata),
                session_id=f"{group_id}-{sample_index}",
                apply_chat_template_kwargs=dict(self.options.apply_chat_template_kwargs),
            )
        except Exception as exc:  # a template that fails on this task's messages
            reason, error = StopReason.ENV_ERROR, f"apply_chat_template raised {type(exc).__name__}: {exc}"
        else:
            reason, error, samples = await self._run(args, sample, sampling, record, limits, stop)
        if reason not in (StopReason.ENV_ERROR, StopReason.SERVER_ERROR, StopReason.ABORTED):
            try:
                turns = _all_turns(samples, record)
                rewards, reward = await self._reward(args, samples)
            except Exception as exc:  # a bad Sample, or a reward function that raised
                reason, error = StopReason.ENV_ERROR, f"{type(exc).__name__}: {exc}"
        if reason == StopReason.ENV_ERROR:
            self._log_once(error)
        traj = Trajectory(
            task_id=task.id,
            group_id=group_id,
            sample_index=sample_index,
            turns=turns,
            stop_reason=reason,
            rewards=rewards,
            reward=reward,
            timings={"episode": time.monotonic() - t0},
            env=self.name,
            error=error,
            metrics={
                "turns": float(len(turns)),
                "model_calls": float(len(record.calls)),
                "samples": float(len(samples)),
                "completion_tokens": float(sum(len(t.completion_ids) for t in turns)),
            },
        )
        if self.options.group_rm and turns:
            self._pending[traj.id] = (args, samples)
            while len(self._pending) > _REMEMBERED:
                self._pending.popitem(last=False)
        return traj

    async def _run(
        self, args: Any, sample: Sample, sampling: Sampling, record: _Record, limits: Limits, stop: asyncio.Event | None
    ) -> tuple[StopReason, str, list[Sample]]:
        # The function runs in its own task whose context holds this episode's record (for `post`).
        ctx = contextvars.copy_context()
        ctx.run(_EPISODE.set, record)
        params = {k: v for k, v in slime_sampling_params(args).items() if v is not None}
        if sampling.sampling_seed is not None:
            params["sampling_seed"] = sampling.sampling_seed
        call = (
            self.generate(args, sample, params, evaluation=self.options.evaluation)
            if self._takes_evaluation
            else self.generate(args, sample, params)
        )
        job = asyncio.get_running_loop().create_task(call, context=ctx)
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
                return StopReason.ABORTED, "stopped by the caller", []
            return StopReason.EPISODE_TIMEOUT, "", []
        exc = job.exception()
        if exc is not None:
            kind = StopReason.SERVER_ERROR if isinstance(exc, ServerError) else StopReason.ENV_ERROR
            return kind, f"generate function raised {type(exc).__name__}: {exc}", []
        result = job.result()
        samples = list(result) if isinstance(result, list | tuple) else [result]
        if not samples:
            return StopReason.ENV_ERROR, "the generate function returned an empty list of samples", []
        for i, s in enumerate(samples):
            if isinstance(s, Sample) and isinstance(s.status, str):  # tau-bench passes the value ("completed")
                try:
                    s.status = Sample.Status(s.status)
                except ValueError:
                    return StopReason.ENV_ERROR, f"{_which(i, samples)}status {s.status!r} is not a Sample.Status", []
        return (*_stop_reason(samples), samples)

    async def _reward(self, args: Any, samples: list[Sample]) -> tuple[dict[str, float], float]:
        """Rewards as slime's generate_and_rm: a sample's own, else the reward function (or rm_type);
        a list goes to `batched_async_rm` at once. With group_rm, they come with the group."""
        if self.options.group_rm:
            return {}, 0.0
        need = [s for s in samples if s.reward is None]
        if len(samples) == 1 and need:
            need[0].reward = await async_rm(args, need[0])
        elif need:
            for s, r in zip(need, await batched_async_rm(args, need), strict=True):
                s.reward = r
        values = [self._value(args, s, i, samples) for i, s in enumerate(samples)]
        value = self._combine(values)
        named = {"reward": value}
        if len(samples) == 1 and isinstance(samples[0].reward, dict):
            named = {k: float(v) for k, v in samples[0].reward.items() if isinstance(v, int | float)}
        elif len(samples) > 1:
            named.update({"sample_reward_min": min(values), "sample_reward_max": max(values)})
        return named, value

    def _value(self, args: Any, sample: Sample, i: int, samples: list[Sample]) -> float:
        r = sample.reward
        if r is None:
            raise ValueError(
                f"{_which(i, samples)}has no reward: set sample.reward in the function, name a reward "
                "function (env.args.reward) or set env.args.rm_type"
            )
        if isinstance(r, dict) and (not self.reward_key or self.reward_key not in r):
            raise KeyError(
                f"{_which(i, samples)}reward is a dict with keys {sorted(r)}: set env.args.reward_key "
                "to the one that trains"
            )
        return float(sample.get_reward_value(args))

    def _combine(self, values: list[float]) -> float:
        how = self.options.list_reward
        if how == "last":
            return values[-1]
        return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}[how]

    def _group_rm_fn(self) -> Callable[..., Awaitable[list[float]]]:
        async def group_rm(trajectories: list[Trajectory]) -> list[float]:
            # slime's --group-rm: one call of the reward function with every sample of the group
            found = [self._pending.pop(t.id, None) for t in trajectories]
            if any(f is None for f in found):
                raise RuntimeError("group_rm: a trajectory of the group is not one this adapter made")
            every = [s for _, ss in found for s in ss]  # type: ignore[misc]
            args = found[0][0]  # type: ignore[index]
            for s, r in zip(every, await batched_async_rm(args, every), strict=True):
                s.reward = r
            return [self._combine([self._value(args, s, i, ss) for i, s in enumerate(ss)]) for _, ss in found]  # type: ignore[misc]

        return group_rm

    def _log_once(self, error: str) -> None:
        """Say each kind of failure once at ERROR: a function that fails every episode is then seen at
        once, not only as a drop count."""
        key = error[:120]
        if key not in self._errors_seen and len(self._errors_seen) < 64:
            self._errors_seen.add(key)
            log.error("%s: episode failed: %s", self.name, error)


def _which(i: int, samples: list[Sample]) -> str:
    return f"sample {i} of the {len(samples)} returned: " if len(samples) > 1 else "the sample "


def _stop_reason(samples: list[Sample]) -> tuple[StopReason, str]:
    statuses = [s.status if isinstance(s, Sample) else None for s in samples]
    for i, st in enumerate(statuses):
        if st == Sample.Status.FAILED:
            which = f"sample {i} of {len(samples)}" if len(samples) > 1 else "the sample"
            return StopReason.ENV_ERROR, f"the generate function marked {which} FAILED"
    if Sample.Status.ABORTED in statuses:
        return StopReason.ABORTED, "the generate function marked a sample ABORTED"
    if Sample.Status.TRUNCATED in statuses:
        return StopReason.TRUNCATED, ""
    return StopReason.DONE, ""


def _all_turns(samples: list[Sample], record: _Record) -> list[Turn]:
    turns: list[Turn] = []
    for i, s in enumerate(samples):
        try:
            turns += to_turns(s, record.calls, new_branch=i > 0)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{_which(i, samples)}does not fit: {exc}" if len(samples) > 1 else str(exc)) from None
    return turns
