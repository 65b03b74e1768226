"""Loading the config tree from YAML plus `key.sub=value` overrides, with errors that name the place.

Every error is one `ConfigError` whose message says where (file, line or override), which field
(its dotted path), what was given and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import sys
import types as pytypes
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from slime_async.config.schema import Config


class _Loader(yaml.SafeLoader):
    """YAML 1.1's SafeLoader, except that `1e-4` is a float as in YAML 1.2 (and every other
    language): 1.1 reads exponents without a dot as strings, a trap for learning rates."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the place and what is allowed."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), type: type[T] = Config) -> T:
    """Read `path` (YAML; None for all defaults), apply `overrides`, validate, return the tree."""
    origin = str(path) if path is not None else "defaults"
    raw = _read_yaml(Path(path)) if path is not None else {}
    override_paths: list[tuple[str, ...]] = []
    for text in overrides:
        keys, value = parse_override(text)
        if _unwrap(_field_type(type, keys)) is str and not isinstance(value, str | list | dict):
            value = text.partition("=")[2].strip()  # `run.name=123` means the string "123"
        _set_path(raw, keys, value, text)
        override_paths.append(keys)

    def where(keys: tuple[str, ...]) -> str:
        for o, text in zip(override_paths, overrides, strict=True):
            if keys[: len(o)] == o or o[: len(keys)] == keys:
                return f"override {text}"
        return origin

    _check_unknown_keys(raw, type, (), where)
    try:
        config = msgspec.convert(raw, type)
    except msgspec.ValidationError as exc:
        raise _explain(exc, raw, type, where) from None
    if isinstance(config, Config):
        config = use_python_path(config, Path(path).resolve().parent if path is not None else None)
    return config


def use_python_path(config: Config, base: Path | None) -> Config:
    """`config` with `run.python_path` made absolute (relative to `base`, the config file's directory),
    those directories appended to `sys.path` of this process. The resolved config is what child
    processes read, so they import from the same directories wherever they start. Without a file
    (`base` None) the entries are relative to the current directory and the config is left as it is."""
    paths = [str(((base or Path.cwd()) / entry).resolve()) for entry in config.run.python_path]
    for entry in paths:
        if entry not in sys.path:
            sys.path.append(entry)  # after installed packages: a file of yours cannot hide one of theirs
    if base is None:
        return config
    return msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, python_path=paths))


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Split `a.b.c=value` into its key path and its value (parsed as YAML: 3, 0.5, true, [1, 2])."""
    key, sep, value = text.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise ConfigError(f"override {text!r}: expected key.sub=value, e.g. rollout.group_size=8")
    try:
        parsed = yaml.load(value, Loader=_Loader) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_first_line(exc)})") from None
    return keys, parsed


def to_yaml(config: msgspec.Struct) -> str:
    """The resolved config as YAML, in the schema's field order (what `config show` prints)."""
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False, default_flow_style=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{at}: invalid YAML: {_first_line(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (run:, model:, ...), got {_kind(raw)}")
    return raw


def _set_path(raw: dict[str, Any], keys: tuple[str, ...], value: Any, text: str) -> None:
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: i + 1])
            raise ConfigError(f"override {text}: {where} is a {_kind(child)}, not a section")
        node = child
    node[keys[-1]] = value


def _check_unknown_keys(raw: Any, tp: Any, path: tuple[str, ...], where: Any) -> None:
    """Reject keys the schema does not have, suggesting the nearest one."""
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)) or not isinstance(raw, dict):
        return  # a wrong type here is reported by msgspec with the allowed type
    hints = typing.get_type_hints(tp, include_extras=True)
    names = list(tp.__struct_fields__)
    for key, value in raw.items():
        keys = (*path, str(key))
        if key not in hints:
            dotted = ".".join(keys)
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            section = ".".join(path) or "the top level"
            # a section of hundreds of keys (sglang: SGLang's ServerArgs) is named, not listed
            takes = ", ".join(names) if len(names) <= 40 else f"{len(names)} keys; see its documentation"
            raise ConfigError(f"{where(keys)}: {dotted}: unknown key{hint} ({section} takes: {takes})")
        _check_unknown_keys(value, _unwrap(hints[key]), keys, where)


def _unwrap(tp: Any) -> Any:
    """The Struct type inside `Annotated[...]` or `X | None`, if any."""
    if typing.get_origin(tp) is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(tp) in (typing.Union, pytypes.UnionType):
        return _unwrap(args[0])
    return tp


_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _explain(exc: msgspec.ValidationError, raw: Any, tp: Any, where: Any) -> ConfigError:
    message = str(exc)
    match = _MSGSPEC_PATH.search(message)
    parts: list[str | int] = []
    if match:
        message = message[: match.start()]
        for name, index in _PATH_PART.findall(match.group("path")):
            parts.append(name if name else int(index))
    keys = tuple(str(p) for p in parts if isinstance(p, str))
    dotted = "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in parts).lstrip(".")
    value = _lookup(raw, parts)
    if not parts:  # a check across sections (`Config.__post_init__`): its message names the fields
        return ConfigError(f"{where(keys)}: {message}")
    expected = _describe(message, _field_type(tp, keys))
    return ConfigError(f"{where(keys)}: {dotted}: got {value!r}; expected {expected}")


def _describe(message: str, field_type: Any) -> str:
    """Turn msgspec's 'Expected `int` >= 1' into 'int >= 1'; list a Literal's allowed values."""
    literal = _literal_values(field_type)
    if literal is not None:
        return "one of " + ", ".join(repr(v) for v in literal)
    message = re.sub(r"^Expected ", "", message).replace("`", "")
    message = re.sub(r", got \w+$", "", message)
    return {"object": "a mapping", "array": "a list"}.get(message, message)


def _literal_values(tp: Any) -> tuple[Any, ...] | None:
    tp = _unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def _field_type(tp: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        tp = _unwrap(tp)
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return None
        tp = typing.get_type_hints(tp, include_extras=True).get(key)
    return tp


def _lookup(raw: Any, parts: list[str | int]) -> Any:
    for p in parts:
        try:
            raw = raw[p]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _first_line(exc: Exception) -> str:
    """YAML's own words for the problem, without the quoted snippet it prints after them."""
    problem = getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    if problem:
        return f"{problem} ({context})" if context else str(problem)
    return " ".join(str(exc).split())
