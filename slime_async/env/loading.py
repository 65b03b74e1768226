"""From the config's `env.name` ("module:Class") and `env.args` to episodes and tasks."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import msgspec

from slime_async.env.base import Env, EnvArgs, Split
from slime_async.env.episode import run_episode
from slime_async.env.policy import Policy
from slime_async.types import Task, Trajectory


class EnvLoadError(ValueError):
    """`env.name` or `env.args` is wrong; the message names the place and the fix."""


class EnvFactory:
    """Makes a fresh Env per episode, all with the same validated arguments."""

    def __init__(self, cls: type[Env], args: EnvArgs, name: str = "") -> None:
        self.cls, self.args = cls, args
        self.name = name or f"{cls.__module__}:{cls.__qualname__}"

    @classmethod
    def from_config(cls, name: str, args: dict[str, Any] | None = None) -> EnvFactory:
        """`EnvFactory.from_config("envs.calculator:CalculatorEnv", {"seed": 1})`."""
        env_cls = load_env_class(name)
        try:
            parsed = msgspec.convert(args or {}, env_cls.Args)
        except msgspec.ValidationError as exc:
            fields = ", ".join(env_cls.Args.__struct_fields__)
            raise EnvLoadError(f"env.args: {exc} (for {name}; it takes: {fields})") from None
        return cls(env_cls, parsed, name)

    def new(self) -> Env:
        """A fresh instance for one episode."""
        return self.cls(self.args)

    def tasks(self, split: Split) -> Iterable[Task]:
        """The environment's own tasks for a split (train or eval), deterministic by `args.seed`."""
        return self.cls.tasks(self.args, split)

    def for_task(self, task: Task) -> EnvFactory:
        """The factory that serves `task`: this one. A router over several environments
        (`slime_async.data.EnvRouter`) answers per task; the scheduler asks through this method."""
        return self

    async def episode(self, task: Task, policy: Policy, tokenizer: Any, **kwargs: Any) -> Trajectory:
        """One episode of `task` with a fresh environment (`run_episode`'s keyword arguments pass
        through). A subclass may run episodes another way (the slime-style adapter does)."""
        return await run_episode(self.new(), task, policy, tokenizer, env_name=self.name, **kwargs)


def import_named(name: str, setting: str, example: str, kind: str = "name") -> Any:
    """The object `module:<kind>` names; EnvLoadError names the setting and what is wrong."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise EnvLoadError(f"{setting}: {name!r} is not 'module:{kind}' (e.g. {example!r})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvLoadError(f"{setting}: cannot import module {module_name!r}: {exc} (a module of yours: run "
                           "from its directory, or put that directory on PYTHONPATH)") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise EnvLoadError(f"{setting}: module {module_name!r} has no {attr!r}")
    return obj


def load_env_class(name: str) -> type[Env]:
    """Import `module:Class` and check that it is an Env subclass."""
    obj = import_named(name, "env.name", "envs.calculator:CalculatorEnv", "Class")
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise EnvLoadError(f"env.name: {name} is not a subclass of slime_async.env.Env")
    return obj
