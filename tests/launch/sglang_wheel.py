"""SGLang's own command-line parser, built from its wheel on a machine where SGLang cannot import.

SGLang's `ServerArgs` flags are made by `sglang.srt.arg_groups.arg_utils.add_cli_args_from_dataclass`
from the field classes in `sglang/srt/arg_groups/fields/`. Those modules need only msgspec and a few
helpers from modules that pull SGLang's GPU stack (`sglang.srt.utils.common`, ...): the helpers
are replaced by permissive placeholders (type parsers pass strings through, choice lists accept
anything), and SGLang's real code builds a real argparse parser. What it checks: every flag name,
alias, switch style (store-true, --x/--no-x, several values) and plain type (int, float, choices).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

STUBBED = ["sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.model_executor",
           "sglang.srt.model_executor.cuda_graph_config", "sglang.srt.lora", "sglang.srt.lora.lora_registry"]


class _Anything(type):
    """A placeholder class: any attribute, item, sum or union of it is itself; it contains everything."""

    def __getattr__(cls, name: str) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __add__(cls, other: Any) -> Any:
        return cls

    __radd__ = __or__ = __ror__ = __add__

    def __iter__(cls) -> Any:
        return iter(())

    def __contains__(cls, item: Any) -> bool:
        return True


class Placeholder(metaclass=_Anything):
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # as a type parser: the string itself
        return args[0] if args else None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ValueError(message)


def sglang_parser(wheel: Path, root: Path) -> argparse.ArgumentParser:
    """A parser with every flag that SGLang's own code derives from its ServerArgs namespaces."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("sglang/srt/arg_groups/") or n == "sglang/srt/server_args.py"]
        zf.extractall(root, names)
    tree = ast.parse((root / "sglang/srt/server_args.py").read_text())
    namespaces = next(
        [e.id for e in node.value.elts] for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets)
    )
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for name in ["sglang", "sglang.srt"]:
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module
    for name in STUBBED:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__getattr__ = lambda attr: Placeholder  # type: ignore[method-assign]
        sys.modules[name] = module
    try:
        arg_utils = importlib.import_module("sglang.srt.arg_groups.arg_utils")
        fields_pkg = root / "sglang/srt/arg_groups/fields"
        classes: dict[str, type] = {}
        for path in sorted(fields_pkg.glob("*.py")):
            module = importlib.import_module(f"sglang.srt.arg_groups.fields.{path.stem}")
            classes.update({k: v for k, v in vars(module).items() if isinstance(v, type)})
        parser = _Parser(prog="sglang.launch_server")
        for name in namespaces:
            arg_utils.add_cli_args_from_dataclass(parser, classes[name])
        return parser
    finally:
        for key in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[key]
        sys.modules.update(saved)
