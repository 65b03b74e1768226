"""`EnvRouter`: one run, several environments; each task's `metadata["env"]` names its own.

The Scheduler asks its factory `for_task(task)` for the EnvFactory of each task (a plain
EnvFactory answers itself), so a router goes wherever an EnvFactory goes. Only names configured
in `data.envs` are accepted: a dataset row never chooses which code is imported.
"""

from __future__ import annotations

from collections.abc import Mapping

from slime_async.data.rows import ENV_METADATA_KEY
from slime_async.env import EnvFactory
from slime_async.types import Task


class UnknownEnv(ValueError):
    """A task names an environment that the router does not have."""


class EnvRouter:
    """Picks the EnvFactory of a task by `task.metadata["env"]`; `default` serves tasks without one."""

    def __init__(self, factories: Mapping[str, EnvFactory], default: str | None = None) -> None:
        if not factories:
            raise ValueError("EnvRouter needs at least one environment (data.envs)")
        if default is not None and default not in factories:
            raise ValueError(f"default environment {default!r} is not one of {sorted(factories)}")
        self.factories = dict(factories)
        self.default = default
        self.name = "router(" + ",".join(sorted(self.factories)) + ")"

    def for_task(self, task: Task) -> EnvFactory:
        """The factory of `task`; raises UnknownEnv naming the value and the choices."""
        name = task.metadata.get(ENV_METADATA_KEY, self.default)
        if name is None:
            raise UnknownEnv(f"task {task.id} names no environment (metadata.env) and there is no default; "
                             f"choices: {sorted(self.factories)}")
        factory = self.factories.get(name)
        if factory is None:
            raise UnknownEnv(f"unknown environment {name!r}; data.envs has: {sorted(self.factories)}")
        return factory

    def check(self, task: Task) -> None:
        """For `TaskStream(validate=...)`: a task with an unknown environment is a bad row."""
        self.for_task(task)
