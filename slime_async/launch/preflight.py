"""Checks a config passes before any process starts: every env it names imports, is an Env, takes
the given arguments, and declares tools and rewards that can be described and called.

A misspelled class, module or argument, a `@tool` parameter without a type hint, a reward asking for
an argument that does not exist, an agent function that cannot be imported: each would otherwise be
found by a child process after the buffer, engines and trainer had started, and printed as a
traceback in its log. Here it is one `ConfigError` line naming the setting (with the nearest
existing name when there is one), which the command line prints with exit code 2.
"""

from __future__ import annotations

from collections.abc import Iterator

from slime_async.config import Config, ConfigError
from slime_async.config.schema import EnvConfig


def env_settings(cfg: Config) -> Iterator[tuple[str, EnvConfig]]:
    """Every env the config names, with the setting that names it."""
    if not cfg.data.envs:
        yield "", cfg.env
    for name, env in cfg.data.envs.items():
        yield f"data.envs.{name}: ", env
    if cfg.warmstart.enabled and cfg.warmstart.env is not None:
        yield "warmstart.env: ", cfg.warmstart.env
    for i, suite in enumerate(cfg.data.eval):
        if suite.env is not None:
            yield f"data.eval[{i}].env: ", suite.env


def check_envs(cfg: Config) -> list[str]:
    """Build the factory of every env the config names (importing its module, checking its arguments
    and, through the import, its tools' schemas and rewards' arguments); the names checked. Raises
    ConfigError with one line when one cannot be built."""
    from slime_async.data.build import env_factory  # lazily: `slime-async --help` needs none of it

    names = []
    for setting, env in env_settings(cfg):
        try:
            factory = env_factory(env)
        except (ValueError, TypeError, ImportError) as exc:  # EnvLoadError is a ValueError
            message = " ".join(str(exc).split())  # one line, whatever the env's own message looks like
            raise ConfigError(f"{setting}{message}") from None
        names.append(factory.name)
    check_functions(cfg)
    return names


def check_functions(cfg: Config) -> None:
    """Import the group filter, advantage and policy-loss functions the config names (one ConfigError
    line naming the setting when one cannot be)."""
    from slime_async.env import EnvLoadError
    from slime_async.rollout.filters import load_group_filter
    from slime_async.train.objective import Objective

    try:
        load_group_filter(cfg.rollout)
        Objective(cfg.train)
    except (EnvLoadError, ValueError) as exc:
        raise ConfigError(" ".join(str(exc).split())) from None
