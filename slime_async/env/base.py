"""The `Env` base class: one instance per episode, async, with tools and verifiers declared on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import msgspec

from slime_async.env.limits import Limits
from slime_async.env.rewards import RewardSpec
from slime_async.env.tools import ToolSpec
from slime_async.env.verify import VerifierPool
from slime_async.types import Message, Task

Split = Literal["train", "eval"]


class EnvArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments every environment takes (`env.args` in the config). Subclass it for your own."""

    seed: int = 0
    """Seed of task generation (and of anything random in the environment)."""
    limits: Limits = msgspec.field(default_factory=Limits)


class Env:
    """Base class of environments. Subclass it; declare tools with `@tool`, rewards with
    `@reward`, metrics with `@metric`, group rewards with `@group_reward`.

    Lifecycle of one episode (driven by `run_episode`): `setup(task)` → `prompt(task)` → loop of
    model replies, tool calls (or `on_reply` for a reply without calls) → rewards → `teardown()`,
    which runs whatever happened (error, timeout, cancellation). State lives on the instance:
    one instance serves exactly one episode.
    """

    Args: ClassVar[type[EnvArgs]] = EnvArgs
    """The arguments' type; `env.args` from the config are validated against it."""
    system_prompt: ClassVar[str | None] = None
    """Prepended as a system message by the default `prompt`."""
    show_tools: bool = True
    """Pass the tools' schemas to the chat template (it lists them in the system prompt). A tiny
    model that learns its one tool from demonstrations can do without the tokens. An instance may
    override it (from its args)."""

    tools: ClassVar[dict[str, ToolSpec]] = {}
    rewards: ClassVar[dict[str, RewardSpec]] = {}
    metrics: ClassVar[dict[str, RewardSpec]] = {}
    group_rewards: ClassVar[dict[str, RewardSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tools, cls.rewards, cls.metrics, cls.group_rewards = {}, {}, {}, {}
        seen: set[str] = set()
        for klass in cls.__mro__:  # the subclass's definition wins over its bases'
            for attr, value in vars(klass).items():
                if attr in seen:
                    continue
                seen.add(attr)
                fn = value.__func__ if isinstance(value, staticmethod) else value
                if spec := getattr(fn, "__slime_tool__", None):
                    cls.tools[spec.name] = spec
                if spec := getattr(fn, "__slime_reward__", None):
                    {"reward": cls.rewards, "metric": cls.metrics, "group_reward": cls.group_rewards}[spec.kind][
                        spec.name
                    ] = spec

    def __init__(self, args: EnvArgs | None = None) -> None:
        self.args = args if args is not None else self.Args()
        self.task: Task | None = None
        self.done = False
        """Set (or call `finish()`) to end the episode with StopReason.DONE after the current turn."""
        self.verifiers: VerifierPool | None = None
        """The process pool for `verify`, given by whoever runs the episode (None: a thread)."""

    @property
    def limits(self) -> Limits:
        return self.args.limits

    # ---- tasks -------------------------------------------------------------------------------

    @classmethod
    def tasks(cls, args: EnvArgs, split: Split) -> Iterable[Task]:
        """The tasks of a split, deterministic given `args.seed`. Environments that generate their
        own tasks override this; others get tasks from a dataset (the scheduler's concern)."""
        raise NotImplementedError(f"{cls.__name__} does not generate tasks; give the scheduler a dataset")

    @classmethod
    def demonstration(cls, args: EnvArgs, task: Task) -> list[str]:
        """The assistant's replies of a correct episode of `task` (tool calls in the model's
        format, then the answer), for the supervised warm-start (`warmstart:` in the config).
        Environments that can write one override this."""
        raise NotImplementedError(f"{cls.__name__} has no demonstrations")

    # ---- episode hooks -----------------------------------------------------------------------

    async def setup(self, task: Task) -> None:
        """Prepare per-episode state (start a sandbox, open a session). Raising ends the episode
        with StopReason.ENV_ERROR."""

    def prompt(self, task: Task) -> list[Message]:
        """The opening messages: the task's own, or the system prompt and the task as a user turn."""
        if isinstance(task.prompt, list):
            return list(task.prompt)
        messages = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return [*messages, Message(role="user", content=task.prompt)]

    async def on_reply(self, message: Message) -> list[Message] | None:
        """Called for a reply without tool calls. Return the messages that answer it (a user
        simulator, game feedback) to go on, or None to end the episode (StopReason.DONE)."""
        return None

    async def teardown(self) -> None:
        """Release what `setup` took. Runs after every episode, however it ended."""

    async def drive(self, session: Any) -> float | None:
        """Override to drive the episode from outside instead of the model-call loop: the episode
        calls it once, after `setup`, with a session (`slime_async.env.driven.DrivenEpisode`)
        whose `complete(messages, ...)` makes model calls, recorded token-exactly as turns. It
        returns the episode's reward (`rewards["agent"]`) or None (the env's `@reward`s alone).
        `slime_async.agents.AgentEnv` drives it with an agent program over the OpenAI API."""
        raise NotImplementedError

    # ---- helpers for subclasses --------------------------------------------------------------

    def finish(self) -> None:
        """End the episode after the current turn (StopReason.DONE)."""
        self.done = True

    def injected(self, name: str) -> Any:
        """The value of a tool's injected argument `name`. Known: `task`, `env`, `args`;
        override to add your own (call super() for these)."""
        values = {"task": self.task, "env": self, "args": self.args}
        if name not in values:
            raise KeyError(f"{type(self).__name__}.injected has no value for {name!r}; override injected()")
        return values[name]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [spec.schema for spec in self.tools.values()]

    async def verify(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run a CPU-heavy or untrusted check `fn(*args)` off the event loop: in the process pool
        when one was given (`fn` must then be a module-level function), else in a thread.
        Raises TimeoutError past `timeout_s` (default: the reward timeout)."""
        timeout = timeout_s if timeout_s is not None else self.limits.reward_timeout_s
        if self.verifiers is not None:
            return await self.verifiers.run(fn, *args, timeout_s=timeout)
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
