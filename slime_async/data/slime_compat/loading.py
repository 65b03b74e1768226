"""Importing the functions a slime port names (`module:function`, or slime's `module.function`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from slime_async.env import EnvLoadError


def load_function(path: str, what: str = "function") -> Callable[..., Any]:
    """The function at `path`; also stands for `slime.utils.misc.load_function`. A path that does not
    load is an EnvLoadError (a ValueError) of one line naming `what`, the path and the cause."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise EnvLoadError(f"{what}: function path {path!r} is not 'module:function' (or 'module.function')")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module that raises on import (a missing dependency) is a load failure too
        raise EnvLoadError(
            f"{what}: cannot load {path!r}: importing {module_name!r} raised {type(exc).__name__}: "
            f"{exc} (a module of yours: run from its directory or put it on PYTHONPATH)"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise EnvLoadError(f"{what}: cannot load {path!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise EnvLoadError(f"{what}: {path!r} is a {type(fn).__name__}, not a function")
    return fn
