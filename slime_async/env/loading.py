"""From the config's `env.name` ("module:Class") and `env.args` to episodes and tasks."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
import traceback
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from slime_async.env.base import Env, EnvArgs, Split
from slime_async.env.episode import run_episode
from slime_async.env.policy import Policy
from slime_async.env.tools import DefinitionError
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
            raise EnvLoadError(f"env.args: {exc}{_arg_hint(str(exc), env_cls.Args)} (for {name}; it takes: "
                               f"{', '.join(env_cls.Args.__struct_fields__)})") from None
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


_OWN_DIR = str(Path(__file__).resolve().parents[1])
"""slime_async's own code, whose frames say nothing about where the user's module went wrong."""

WHERE_MODULES_ARE = ("modules are found in the config file's directory (run.python_path), the current "
                     "directory and PYTHONPATH")


def import_named(name: str, setting: str, example: str, kind: str = "name") -> Any:
    """The object `module:<kind>` names; EnvLoadError names the setting, what is wrong and, for a
    misspelled module or attribute, the nearest existing name."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise EnvLoadError(f"{setting}: {name!r} is not 'module:{kind}' (e.g. {example!r})")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if not (module_name == missing or module_name.startswith(missing + ".")):  # the module's own import
            raise EnvLoadError(f"{setting}: module {module_name!r} imports {missing!r}, which is not installed "
                               f"(pip install it into this environment)") from None
        raise EnvLoadError(f"{setting}: cannot import module {module_name!r}: {exc}"
                           f"{_did_you_mean(missing, _sibling_modules(missing))} "
                           f"({WHERE_MODULES_ARE})") from None
    except DefinitionError as exc:  # its message names the class, the function and the parameter
        raise EnvLoadError(f"{setting}: {name}: {exc}") from None
    except Exception as exc:  # the module itself raised (a syntax error, a failing import-time line)
        raise EnvLoadError(f"{setting}: importing {module_name!r} failed: {_where(exc)}"
                           f"{type(exc).__name__}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        names = [n for n in vars(module) if not n.startswith("_")]
        raise EnvLoadError(f"{setting}: module {module_name!r} has no {attr!r}{_did_you_mean(attr, names)}")
    return obj


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _sibling_modules(dotted: str) -> list[str]:
    """Modules beside the one `dotted` names: its parent package's, or the top-level ones."""
    parent, _, _ = dotted.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return []
    return [f"{parent}.{m.name}" if parent else m.name for m in pkgutil.iter_modules(path)]


def _where(exc: BaseException) -> str:
    """`file:line: ` of the user's code that raised while importing (not importlib's frames)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: "
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in f.filename and not f.filename.startswith(_OWN_DIR)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""


def _arg_hint(message: str, args_type: type) -> str:
    """`; did you mean 'seed'?` for msgspec's "unknown field `sed`" (also inside nested arguments)."""
    match = re.search(r"unknown field `([^`]+)`(?: - at `\$([^`]*)`)?", message)
    if not match:
        return ""
    tp: Any = args_type
    for part in filter(None, (match.group(2) or "").split(".")):
        tp = typing.get_type_hints(tp).get(part) if isinstance(tp, type) else None
    fields = getattr(tp, "__struct_fields__", ())
    return _did_you_mean(match.group(1), fields)


def load_env_class(name: str) -> type[Env]:
    """Import `module:Class` and check that it is an Env subclass."""
    obj = import_named(name, "env.name", "envs.calculator:CalculatorEnv", "Class")
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise EnvLoadError(f"env.name: {name} is not a subclass of slime_async.env.Env")
    return obj
