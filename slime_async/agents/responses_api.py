"""OpenAI's Responses API: the request as this endpoint accepts it, the response and its SSE events.

`POST /v1/responses` (the `openai` SDK's `client.responses`). The request maps onto the session's
conversation:

- `instructions` is a system message; `input` a user message when it is a string, else its items:
- a `message` item (with or without `"type": "message"`) is a message of its role (`developer` is
  `system`), its text parts (`input_text`, `output_text`) its content;
- `function_call` items are the tool calls of the assistant message they follow (or of a new one with
  no text), `call_id` their id; a `function_call_output` item is a tool message answering `call_id`;
- `tools` (`{"type": "function", "name", "description", "parameters"}`) are function schemas.

So the response's `output` items, appended to `input` as they are (`input += response.output`), are the
message the session holds, and the conversation goes on token for token. Nothing is stored: a
`previous_response_id` is refused (send the whole conversation, as with `store: false`), as are other
values this endpoint cannot honour (reasoning, structured output, forced tool choice, images), each named.
Replies follow the API reference: a `response` object, or its SSE events (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `.done`, `response.function_call_arguments.delta` / `.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed`), each with its
`sequence_number`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

from slime_async.agents.openai_api import error_object
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


class _Part(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    # what an SDK echoes back from an output_text part: accepted, they change nothing
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    # an image's or a file's (refused, by type, with a clear error)
    image_url: Any = None
    file_id: Any = None
    detail: Any = None


class _Item(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An input item of any type; which fields a type needs is checked in `to_messages`."""

    type: str = "message"
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None
    # what an SDK echoes back from an output item: accepted, they change nothing
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Format(msgspec.Struct, kw_only=True):
    type: str


class _Text(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: _Format | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses`, the fields this endpoint knows."""

    input: str | list[_Item]
    model: str = ""
    instructions: str | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: _Text | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    # informational: they change nothing about what is generated
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None


decode_request = decoder(ResponsesRequest)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_NO_OP_INCLUDES = {"reasoning.encrypted_content"}
"""`include` values that ask for what is never there (no reasoning items): nothing to honour."""


def unsupported(req: ResponsesRequest) -> list[str]:
    """The fields set to values this endpoint cannot honour, each with why."""
    out = []
    if req.previous_response_id is not None:
        out.append("previous_response_id: responses are not stored; send the whole conversation as `input`")
    if req.tool_choice not in (None, "auto", "none"):
        out.append("tool_choice: only 'auto' and 'none' (a model cannot be made to call a tool here)")
    if req.parallel_tool_calls is False:
        out.append("parallel_tool_calls: false is not enforced (the model may reply with several calls)")
    if req.reasoning:
        out.append("reasoning: reasoning models' options are not supported")
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        out.append(f"text.format.type: only 'text', not {req.text.format.type!r} (no structured output)")
    for value in req.include or []:
        if value not in _NO_OP_INCLUDES:
            out.append(f"include: {value!r} is not supported")
    if req.top_logprobs:
        out.append("top_logprobs: the servers return the sampled token's logprob only")
    if req.truncation not in (None, "disabled"):
        out.append("truncation: only 'disabled' (the session never drops context by itself)")
    if req.background:
        out.append("background: responses are answered in the request")
    if req.max_tool_calls is not None:
        out.append("max_tool_calls: not enforced (the env's limits.max_tool_calls bounds the episode)")
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function" or tool.name is None:
            out.append(f"tools[{i}]: only function tools (with a name), not {tool.type!r}")
    return out


def to_messages(req: ResponsesRequest) -> list[Message]:
    """The instructions and input items as the env API's messages (see the module's docstring)."""
    out: list[Message] = []
    if req.instructions:
        out.append(Message(role="system", content=req.instructions))
    if isinstance(req.input, str):
        return [*out, Message(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise BadCall(f"{where}.role: {item.role!r} is not one of {', '.join(_ROLES)}")
            out.append(Message(role=role, content=_text(item.content, where + ".content")))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise BadCall(f"{where}: a function_call needs its call_id and name")
            call = ToolCall(id=item.call_id, name=item.name,
                            arguments=arguments(item.arguments or "", where + ".arguments"))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_call_id is None:
                last.tool_calls = [*last.tool_calls, call]  # the calls of the reply whose text came before
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise BadCall(f"{where}.call_id: a function_call_output must name the call it answers")
            out.append(Message(role="tool", tool_call_id=item.call_id,
                               content=_text(item.output or "", where + ".output")))
        else:
            raise BadCall(f"{where}.type: {item.type!r} items are not supported (message, function_call, "
                          "function_call_output are)")
    return out


def _text(content: str | list[_Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise BadCall(f"{where}[{j}]: only text parts are supported, not {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


# ---- replies -----------------------------------------------------------------------------------


def _output(c: Completion, done: bool = True) -> list[dict[str, Any]]:
    """The output items of a reply: a message with its text (also when empty and there is no call),
    then one function_call item per call."""
    status = "completed" if done else "in_progress"
    out: list[dict[str, Any]] = []
    if c.message.content or not c.message.tool_calls:
        out.append({"type": "message", "id": "msg_" + new_id()[:24], "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": c.message.content, "annotations": []}]})
    out += [{"type": "function_call", "id": "fc_" + new_id()[:24], "call_id": t.id, "name": t.name,
             "arguments": arguments_json(t), "status": status} for t in c.message.tool_calls]
    return out


def _response(call: Call, c: Completion, output: list[dict[str, Any]], done: bool, rid: str) -> dict[str, Any]:
    req: ResponsesRequest = call.request
    cut = c.finish_reason == "length"
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": call.model,
        "status": ("incomplete" if cut else "completed") if done else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if done and cut else None, "error": None,
        "output": output, "instructions": req.instructions, "metadata": req.metadata or {},
        "tools": [msgspec.to_builtins(t) for t in req.tools or []], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": call.sampling.temperature,
        "top_p": call.sampling.top_p, "max_output_tokens": req.max_output_tokens, "store": bool(req.store),
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": len(c.completion_ids), "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": c.prompt_tokens + len(c.completion_ids)} if done else None,
    }  # fmt: skip


class ResponsesApi(Api):
    """`POST /v1/responses`."""

    name = "responses"

    def call(self, body: bytes, default: Sampling) -> Call:
        req = decode_request(body)
        refuse(unsupported(req))
        tools = [function_schema(t.name or "", t.description, t.parameters, t.strict) for t in req.tools or []]
        sampling = over(default, temperature=req.temperature, top_p=req.top_p, max_new_tokens=req.max_output_tokens)
        return Call(request=req, messages=to_messages(req), tools=tools or None, sampling=sampling,
                    parse_tools=bool(tools) and req.tool_choice != "none", stream=bool(req.stream), model=req.model)

    def reply(self, call: Call, completions: list[Completion], tokenizer: Any) -> Any:
        (c,) = completions
        return _response(call, c, _output(c), True, "resp_" + new_id()[:24])

    def events(self, call: Call, completions: list[Completion]) -> list[bytes]:
        (c,) = completions
        rid, items = "resp_" + new_id()[:24], _output(c)
        out: list[bytes] = []

        def event(kind: str, **data: Any) -> None:
            out.append(sse({"type": kind, "sequence_number": len(out), **data}, kind))

        event("response.created", response=_response(call, c, [], False, rid))
        event("response.in_progress", response=_response(call, c, [], False, rid))
        for i, item in enumerate(items):
            at = {"output_index": i, "item_id": item["id"]}
            if item["type"] == "message":
                part = item["content"][0]
                event("response.output_item.added", output_index=i,
                      item={**item, "status": "in_progress", "content": []})
                event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
                event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
                event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
                event("response.content_part.done", **at, content_index=0, part=part)
            else:
                event("response.output_item.added", output_index=i,
                      item={**item, "status": "in_progress", "arguments": ""})
                event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
            event("response.output_item.done", output_index=i, item=item)
        event("response.completed" if c.finish_reason != "length" else "response.incomplete",
              response=_response(call, c, items, True, rid))
        return out

    def error(self, status: int, message: str, code: str | None = None) -> Any:
        return error_object(message, "authentication_error" if status == 401 else "invalid_request_error", code)
