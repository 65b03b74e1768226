"""OpenAI's Chat Completions API (`ChatApi`): the request as this endpoint accepts it, the reply and its SSE chunks.

The request is decoded by msgspec into `ChatRequest`: unknown fields are refused (the error names
them), and so are known fields at values this endpoint cannot honour (`unsupported`), never
silently ignored. Fields that change nothing about generation (`user`, `metadata`, `store`,
`model`, which may name anything) are accepted as they are. Replies follow the OpenAI API
reference: `chat.completion` objects, or `chat.completion.chunk` SSE events ending in `[DONE]`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from slime_async.agents.protocol import (
    Api,
    Call,
    arguments,
    arguments_json,
    decoder,
    function_schema,
    over,
    refuse,
    sse,
)
from slime_async.env import Sampling
from slime_async.env.driven import BadCall, Completion
from slime_async.types import Message, ToolCall, new_id

MAX_N = 16
"""Samples one request may ask for (`n`): each is a whole generation."""


class _Function(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _CallIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    function: _Function
    type: Literal["function"] = "function"


class _Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class MessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[_Part] | None = None
    tool_calls: list[_CallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # What the SDKs echo back from a reply (`message.model_dump()`): accepted when empty.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class _FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    function: _FunctionDef
    type: Literal["function"] = "function"


class _StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/chat/completions`, the fields this endpoint knows."""

    messages: list[MessageIn]
    model: str = ""
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    seed: int | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0)] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # informational: they change nothing about what is generated
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


decode_request = decoder(ChatRequest)
_ROLES = ("system", "user", "assistant", "tool")


class ChatApi(Api):
    """`POST /v1/chat/completions`."""

    name = "chat.completions"

    def call(self, body: bytes, default: Sampling) -> Call:
        req = decode_request(body)
        refuse(unsupported(req))
        tools = tool_schemas(req)
        return Call(request=req, messages=to_messages(req), tools=tools, sampling=to_sampling(req, default),
                    n=req.n or 1, parse_tools=bool(tools) and req.tool_choice != "none", stream=bool(req.stream),
                    model=req.model)

    def reply(self, call: Call, completions: list[Completion], tokenizer: Any) -> Any:
        return completion_object(completions, call.model, bool(call.request.logprobs), tokenizer)

    def events(self, call: Call, completions: list[Completion]) -> list[bytes]:
        options = call.request.stream_options
        include_usage = options is not None and options.include_usage
        return [sse(chunk) for chunk in chunks(completions, call.model, include_usage)] + [b"data: [DONE]\n\n"]

    def error(self, status: int, message: str, code: str | None = None) -> Any:
        return error_object(message, _KINDS.get(status, "invalid_request_error"), code)


_KINDS = {401: "authentication_error", 404: "invalid_request_error"}


def unsupported(req: ChatRequest) -> list[str]:
    """The fields set to values this endpoint cannot honour, each with why."""
    out = []
    if req.tool_choice not in (None, "auto", "none"):
        out.append("tool_choice: only 'auto' and 'none' (a model cannot be made to call a tool here)")
    if req.parallel_tool_calls is False:
        out.append("parallel_tool_calls: false is not enforced (the model may reply with several calls)")
    if req.top_logprobs:
        out.append("top_logprobs: the servers return the sampled token's logprob only")
    if req.frequency_penalty or req.presence_penalty:
        out.append("frequency_penalty / presence_penalty: only 0")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        out.append("max_tokens and max_completion_tokens differ: give one")
    return out


def to_messages(req: ChatRequest) -> list[Message]:
    """The request's messages as the env API's, in the shape the chat template takes."""
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
        if role not in _ROLES:
            raise BadCall(f"{where}.role: {m.role!r} is not one of {', '.join(_ROLES)} (or developer)")
        if m.audio is not None or m.function_call is not None:
            raise BadCall(f"{where}: audio and function_call are not supported (use tool_calls)")
        content = _text(m.content, where)
        calls = [ToolCall(id=c.id, name=c.function.name,
                          arguments=arguments(c.function.arguments, f"{where}.tool_calls[{j}].function.arguments"))
                 for j, c in enumerate(m.tool_calls or [])]
        if calls and role != "assistant":
            raise BadCall(f"{where}.tool_calls: only assistant messages make calls")
        if role == "tool" and m.tool_call_id is None:
            raise BadCall(f"{where}.tool_call_id: a tool message must name the call it answers")
        out.append(Message(role=role, content=content, tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name))
    return out


def to_sampling(req: ChatRequest, default: Sampling) -> Sampling:
    """The request's sampling parameters over the episode's defaults."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return over(default, temperature=req.temperature, top_p=req.top_p,
                max_new_tokens=req.max_completion_tokens or req.max_tokens, stop=stop, sampling_seed=req.seed)


def tool_schemas(req: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them: the fields given, no nulls (as every API's)."""
    functions = [t.function for t in req.tools or []]
    return [function_schema(f.name, f.description, f.parameters, f.strict) for f in functions] or None


def _text(content: str | list[_Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise BadCall(f"{where}.content[{j}]: only text parts are supported, not {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


# ---- replies -----------------------------------------------------------------------------------


def _message_out(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or (None if message.tool_calls else "")}
    if message.tool_calls:
        out["tool_calls"] = [_call_out(c) for c in message.tool_calls]
    return out


def _call_out(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": arguments_json(call)}}


def _logprobs_out(c: Completion, tokenizer: Any) -> dict[str, Any]:
    return {"content": [{"token": tokenizer.convert_ids_to_tokens(t), "logprob": lp, "bytes": None,
                         "top_logprobs": []} for t, lp in zip(c.completion_ids, c.logprobs, strict=True)]}


def usage(completions: list[Completion]) -> dict[str, int]:
    prompt = completions[0].prompt_tokens if completions else 0
    generated = sum(len(c.completion_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def completion_object(completions: list[Completion], model: str, logprobs: bool = False,
                      tokenizer: Any = None) -> dict[str, Any]:
    """The `chat.completion` object of a reply."""
    return {
        "id": "chatcmpl-" + new_id()[:24], "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "message": _message_out(c.message), "finish_reason": c.finish_reason,
                     "logprobs": _logprobs_out(c, tokenizer) if logprobs else None}
                    for i, c in enumerate(completions)],
        "usage": usage(completions),
    }  # fmt: skip


def chunks(completions: list[Completion], model: str, include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` events of a reply (generated whole, sent as SSE): per choice a
    role, its text, its calls (each whole, with its index) and its finish reason; then usage."""
    base = {"id": "chatcmpl-" + new_id()[:24], "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    out = []

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> None:
        out.append({**base, "choices": choices, **extra})

    for i, c in enumerate(completions):
        chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}])
        if c.message.content:
            chunk([{"index": i, "delta": {"content": c.message.content}, "finish_reason": None, "logprobs": None}])
        for j, call in enumerate(c.message.tool_calls):
            chunk([{"index": i, "delta": {"tool_calls": [{"index": j, **_call_out(call)}]}, "finish_reason": None,
                    "logprobs": None}])
        chunk([{"index": i, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}])
    if include_usage:
        chunk([], usage=usage(completions))
    return out


def error_object(message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
