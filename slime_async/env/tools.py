"""`@tool`: a typed method becomes a tool whose JSON schema comes from its signature.

Argument types and defaults come from type hints; descriptions from `Annotated[T, "text"]`
(or `msgspec.Meta(description=...)`, which also carries bounds such as `ge=0`) and from the
docstring's `Args:` section. Arguments that the model must not see or set (the task, a session
handle) are *injected*: mark them `Annotated[T, Injected]` or list them in `@tool(hidden=...)`;
their values come from `Env.injected(name)`. The model's arguments are validated against the
same types (msgspec, strict: `"3"` is not an int), so the schema the model reads is the one
that is enforced.
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import docstring_parser
import msgspec

ToolResult = Any
"""What a tool returns: a str is shown as is; anything else is shown as JSON."""


class Injected:
    """Marker for a tool argument that the environment supplies: `task: Annotated[Task, Injected]`."""


class ToolError(Exception):
    """Raise from a tool to tell the model what went wrong; the message is shown as `error: ...`."""


class DefinitionError(TypeError):
    """A `@tool`, `@reward`, `@metric` or `@group_reward` that cannot work as declared (a tool's
    parameter without a type hint, a reward's unknown argument); raised when the class is defined, so
    importing the env's module fails with it: the message names the class, the function and the
    parameter."""


class ToolArgumentError(ValueError):
    """The model's arguments do not match the tool's schema; the message says where."""


class ToolSpec:
    """One tool: its schema, how to validate the model's arguments, and how to call it."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, hidden: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        self.description = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)
        arg_docs = {p.arg_name: p.description for p in doc.params if p.description}
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except NameError as exc:
            raise DefinitionError(f"@tool {fn.__qualname__}: cannot resolve a type hint ({exc})") from None
        self.hidden: set[str] = set(hidden)
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        params = list(inspect.signature(fn).parameters.values())[1:]  # skip self
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise DefinitionError(f"@tool {fn.__qualname__}: *args/**kwargs cannot be described to a model")
            if p.name not in hints:
                raise DefinitionError(
                    f"@tool {fn.__qualname__}: parameter {p.name!r} has no type hint; the tool's JSON schema is "
                    f"made from the hints (e.g. `{p.name}: str`, or `Annotated[T, Injected]` for one the env supplies)")
            hint = hints[p.name]
            if _is_injected(hint) or p.name in self.hidden:
                self.hidden.add(p.name)
                continue
            hint = _describe(hint, arg_docs.get(p.name))
            fields.append((p.name, hint) if p.default is p.empty else (p.name, hint, p.default))
        unknown = self.hidden - {p.name for p in params}
        if unknown:
            raise DefinitionError(
                f"@tool {fn.__qualname__}: hidden={sorted(unknown)} are not arguments of the function")
        # A Struct of the visible arguments gives both the schema and the validator.
        self.args_type = msgspec.defstruct(f"{self.name}_args", fields, kw_only=True, forbid_unknown_fields=True)
        self.parameters = _parameters_schema(self.args_type)

    @property
    def schema(self) -> dict[str, Any]:
        """The tool in OpenAI's function format, as chat templates take it."""
        function: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The model's arguments, checked against the schema; ToolArgumentError says what is wrong."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            obj = msgspec.convert(arguments, self.args_type, strict=True)
        except msgspec.ValidationError as exc:
            raise ToolArgumentError(str(exc)) from None
        return {f: getattr(obj, f) for f in obj.__struct_fields__}

    async def invoke(self, env: Any, arguments: dict[str, Any], injected: dict[str, Any]) -> ToolResult:
        """Call the tool; a sync one runs in a thread so that it never blocks the event loop."""
        if self.is_async:
            return await self.fn(env, **arguments, **injected)
        return await asyncio.to_thread(self.fn, env, **arguments, **injected)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, hidden: tuple[str, ...] = ()) -> Any:
    """Declare an Env method as a tool: `@tool` or `@tool(name=..., hidden=("session",))`."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__slime_tool__ = ToolSpec(f, name=name, hidden=tuple(hidden))  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def _is_injected(hint: Any) -> bool:
    return typing.get_origin(hint) is Annotated and any(m is Injected for m in hint.__metadata__)


def _describe(hint: Any, doc: str | None) -> Any:
    """Turn `Annotated[T, "text"]` (and a docstring line) into msgspec's description metadata."""
    base, metas, description = hint, [], None
    if typing.get_origin(hint) is Annotated:
        base = hint.__origin__
        for m in hint.__metadata__:
            if isinstance(m, str):
                description = m
            elif isinstance(m, msgspec.Meta):
                metas.append(m)
                description = description or m.description
    if description is None:
        description = doc
    if description is not None and not any(m.description for m in metas):
        metas.append(msgspec.Meta(description=description))
    return Annotated[(base, *metas)] if metas else base


def _parameters_schema(args_type: type) -> dict[str, Any]:
    (_,), components = msgspec.json.schema_components([args_type], ref_template="#/$defs/{name}")
    params = dict(components.pop(args_type.__name__))
    params.pop("title", None)
    params.setdefault("properties", {})
    params.setdefault("required", [])
    if components:  # nested Structs or enums among the arguments
        params["$defs"] = components
    return params
