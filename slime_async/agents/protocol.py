"""What the endpoint's APIs share: one model call as the session takes it, and the pieces each API reuses.

Each API (`openai_api`: Chat Completions, `anthropic_api`: Anthropic Messages, `responses_api`: OpenAI
Responses) is an `Api`: it decodes its request into a `Call` (the env API's messages and OpenAI
function schemas, the sampling, how many samples), and shapes the session's `Completion`s into its
reply, its SSE events and its error body. The server (`server.py`) does the rest once for all of them:
the session, its key, `DrivenEpisode.complete` (the token bookkeeping), the status codes. So every API
records the same tokens for the same conversation, and a rewritten history is a new segment in each.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from slime_async.env import Sampling
from slime_async.env.driven import BadCall, Completion
from slime_async.types import Message, ToolCall

T = TypeVar("T")
_JSON = msgspec.json.Encoder()


class Call(msgspec.Struct, kw_only=True):
    """One model call, decoded: what `DrivenEpisode.complete` takes, and the request it came from."""

    request: Any
    """The API's own decoded request (its reply may echo fields of it)."""
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    """OpenAI function schemas (`{"type": "function", "function": {...}}`), as chat templates take them."""
    sampling: Sampling
    n: int = 1
    parse_tools: bool = True
    """Whether replies are parsed for tool calls (False for a `tool_choice` of none)."""
    stream: bool = False
    model: str = ""


class Api(ABC):
    """One wire format of model calls (see the module's docstring)."""

    name: str

    @abstractmethod
    def call(self, body: bytes, default: Sampling) -> Call:
        """The request as a Call over the episode's `default` sampling, or BadCall naming what is wrong
        (malformed JSON, an unknown field, a value that cannot be honoured)."""

    @abstractmethod
    def reply(self, call: Call, completions: list[Completion], tokenizer: Any) -> Any:
        """The reply's JSON body."""

    @abstractmethod
    def events(self, call: Call, completions: list[Completion]) -> list[bytes]:
        """The reply as SSE events (generated whole, sent as the API streams them)."""

    @abstractmethod
    def error(self, status: int, message: str, code: str | None = None) -> Any:
        """The API's error body for a 4xx `status`."""


def decoder(cls: type[T]) -> Callable[[bytes], T]:
    """A decoder of `cls` whose errors are BadCalls that name the place (msgspec's `$.field`)."""
    dec = msgspec.json.Decoder(cls)

    def decode(body: bytes) -> T:
        try:
            return dec.decode(body)
        except msgspec.ValidationError as exc:
            raise BadCall(f"invalid request: {exc}") from None
        except msgspec.DecodeError as exc:
            raise BadCall(f"the body is not JSON: {exc}") from None

    return decode


def refuse(problems: list[str]) -> None:
    """BadCall listing every field that cannot be honoured, if any."""
    if problems:
        raise BadCall("cannot be honoured: " + "; ".join(problems))


def over(default: Sampling, **changes: Any) -> Sampling:
    """`default` with the request's sampling fields that are set (None: the episode's)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    return msgspec.structs.replace(default, **changes) if changes else default


def function_schema(name: str, description: str | None, parameters: dict[str, Any] | None,
                    strict: bool | None = None) -> dict[str, Any]:
    """A tool as the chat templates take it (OpenAI's function schema), whatever API declared it."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def arguments(raw: str | dict[str, Any], where: str) -> dict[str, Any]:
    """A call's arguments from their JSON text (or an object already), or BadCall naming `where`."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise BadCall(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise BadCall(f"{where}: not a JSON object")
    return value


def arguments_json(call: ToolCall) -> str:
    """A call's arguments as the JSON text the APIs send (parsed back to the same dict by `arguments`)."""
    return json.dumps(call.arguments, ensure_ascii=False)


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (`event:` line only where the API names its events)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + _JSON.encode(data) + b"\n\n"
