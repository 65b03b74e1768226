"""The `sglang:` config section: SGLang's own `ServerArgs` fields, typed from SGLang's definition.

Every key of the section is a field of SGLang's `ServerArgs` under SGLang's name (`tp_size`,
`mem_fraction_static`, `attention_backend`, ...), and its value is what SGLang's command line would
take for it; `launch` turns the section into `python -m sglang.launch_server ...` per engine. The
field list, each field's flag and kind come from `sglang_server_args.json`, extracted from SGLang's
source by `python -m slime_async.config.sglang_extract` (SGLang does not import on machines without
its GPU stack); where SGLang is importable, the launcher also parses the command with SGLang's own
argument parser before starting anything. Unset fields keep SGLang's defaults.

A few fields belong to the rest of the config, not to this section: the launcher sets them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

import msgspec

SPEC_PATH = Path(__file__).with_name("sglang_server_args.json")
"""The extract of SGLang's ServerArgs (regenerate: `python -m slime_async.config.sglang_extract`)."""

LAUNCHER_OWNED: dict[str, str] = {
    "model_path": "model.path",
    "host": "engine.host (or launch.ray.host)",
    "port": "engine.port (the launcher picks free ports on each node)",
    "weight_version": "the trainer (engines start at the run's version and follow its pushes)",
    "random_seed": "run.seed (engine i gets run.seed + i)",
    "admin_api_key": "engine.admin_token",
    "api_key": "engine.admin_token (the weight and pause endpoints are admin endpoints)",
}
"""ServerArgs fields that the launcher derives from other sections, and where to set them."""


@functools.cache
def server_args_spec() -> dict[str, dict[str, Any]]:
    """field name -> {flag, aliases, kind, optional, choices, default, type_parser} (the checked-in extract)."""
    return json.loads(SPEC_PATH.read_text())["fields"]


def spec_version() -> str:
    return json.loads(SPEC_PATH.read_text())["sglang_version"]


def _field_type(entry: dict[str, Any]) -> Any:
    """The Python type a YAML value of this field must have (always nullable: None keeps SGLang's default)."""
    kind, choices = entry["kind"], entry["choices"]
    if isinstance(choices, list) and choices and kind in ("str", "int") and not entry.get("open_choices"):
        return Literal[tuple(choices)] | None  # type: ignore[valid-type]
    if kind in ("bool", "bool_optional"):
        return bool | None
    if kind == "int":
        return int | None
    if kind == "float":
        return float | None
    if kind == "list":
        return list[str | int | float] | None
    if kind == "str" and entry["type_parser"] is None:
        return str | None
    return Any  # a parsed string (`32k`, JSON) or a custom action: given as YAML, turned into one argument


def _check(self: Any) -> None:
    """Fields the launcher owns, and switches the command line cannot turn off, are refused by name."""
    spec = server_args_spec()
    for name in self.__struct_fields__:
        value = getattr(self, name)
        if value is None:
            continue
        if name in LAUNCHER_OWNED:
            raise ValueError(f"{name}: set by slime_async from {LAUNCHER_OWNED[name]}; remove it from sglang:")
        entry = spec[name]
        if entry["flag"] is None:
            raise ValueError(f"{name}: SGLang's ServerArgs has it, but its command line does not take it")
        if entry["kind"] == "bool" and value is False and entry["default"] is True:
            raise ValueError(f"{name}: SGLang's switch --{name.replace('_', '-')} can only turn it on")


def _build() -> type[msgspec.Struct]:
    fields = [(name, _field_type(entry), None) for name, entry in server_args_spec().items()
              if not name.startswith("_")]
    return msgspec.defstruct(
        "SGLangConfig", fields, kw_only=True, forbid_unknown_fields=True, omit_defaults=True,
        namespace={"__post_init__": _check, "__doc__": __doc__.split("\n\n")[0],
                   "__repr__": lambda self: f"SGLangConfig({set_fields(self)})"},
    )


SGLangConfig = _build()
"""The `sglang:` section (a msgspec Struct built from the extract; unset fields are omitted from YAML)."""


def set_fields(section: msgspec.Struct) -> dict[str, Any]:
    """The fields given in the section (name -> value), in SGLang's order."""
    return {name: getattr(section, name) for name in section.__struct_fields__ if getattr(section, name) is not None}
