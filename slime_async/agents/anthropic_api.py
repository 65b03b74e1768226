"""Anthropic's Messages API: the request as this endpoint accepts it, the reply and its SSE events.

`POST /v1/messages` (the `anthropic` SDK and the harnesses built on it take the base URL *without*
`/v1`: `base_url.removesuffix("/v1")`). The request maps onto the session's conversation:

- `system` (a string or text blocks) is a system message, and so is a message of role `system`
  (Claude Code sends its environment so);
- an assistant message's text blocks are its content, its `tool_use` blocks its tool calls;
- a user message's `tool_result` blocks are tool messages (answering `tool_use_id`), its text blocks
  a user message, in their order;
- `tools` (`name`, `description`, `input_schema`) are function schemas for the chat template.

So a reply echoed back (`{"role": "assistant", "content": reply.content}`) is the message the session
holds, and the conversation goes on token for token. Unknown fields are refused; so are values this
endpoint cannot honour (images, documents, thinking enabled, a forced tool choice, structured output,
context edits other than clearing thinking), each named. `cache_control` marks and `metadata` change
nothing about generation and are accepted; so are `thinking: adaptive`, `output_config.effort` and
`context_management` edits that clear thinking, which Claude Code sends on every call and which a model
that does not think honours as it is. Replies follow the API
reference: a `message` object, or the SSE events `message_start`, `content_block_start` /
`content_block_delta` (`text_delta`, `input_json_delta`) / `content_block_stop`, `message_delta`,
`message_stop`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from slime_async.agents.protocol import Api, Call, arguments, decoder, function_schema, over, refuse, sse
from slime_async.env import Sampling
from slime_async.env.driven import BadCall, Completion
from slime_async.types import Message, ToolCall, new_id


class _Block(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A content block of any type; which fields a type may have is checked in `_blocks`."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[_Block] | None = None
    is_error: bool | None = None
    source: Any = None
    """An image's or a document's (refused, by type, with a clear error)."""
    # informational: they change nothing about what is generated
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class _MessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system"]  # system: what Claude Code sends amid the conversation
    content: str | list[_Block]


class _Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class _ToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Thinking(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    budget_tokens: int | None = None


class _Edit(msgspec.Struct, kw_only=True):
    type: str


class _ContextManagement(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    edits: list[_Edit] = []


class _OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    format: dict[str, Any] | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages`, the fields this endpoint knows."""

    messages: list[_MessageIn]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    model: str = ""
    system: str | list[_Block] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    thinking: _Thinking | None = None
    context_management: _ContextManagement | None = None
    output_config: _OutputConfig | None = None
    # informational: they change nothing about what is generated
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None


decode_request = decoder(MessagesRequest)


def unsupported(req: MessagesRequest) -> list[str]:
    """The fields set to values this endpoint cannot honour, each with why."""
    out = []
    choice = req.tool_choice
    if choice is not None and choice.type not in ("auto", "none"):
        out.append(f"tool_choice.type: only 'auto' and 'none', not {choice.type!r} (a model cannot be made to call "
                   "a tool here)")
    if choice is not None and choice.disable_parallel_tool_use:
        out.append("tool_choice.disable_parallel_tool_use: not enforced (the model may reply with several calls)")
    # "adaptive" leaves thinking to the model, "disabled" turns it off: both are what happens here
    if req.thinking is not None and req.thinking.type not in ("disabled", "adaptive"):
        out.append(f"thinking.type: {req.thinking.type!r}: extended thinking is not supported ('disabled', "
                   "'adaptive')")
    # clearing thinking blocks from the context: there are none (Claude Code asks for it on every call)
    for j, edit in enumerate(req.context_management.edits if req.context_management else []):
        if not edit.type.startswith("clear_thinking"):
            out.append(f"context_management.edits[{j}].type: {edit.type!r}: the session does not edit the context "
                       "(only clear_thinking, a no-op: replies hold no thinking)")
    # effort is a reasoning model's hint (Claude Code sends it): nothing to honour for a model that does not reason
    if req.output_config is not None and req.output_config.format is not None:
        out.append("output_config.format: structured output is not supported")
    return out


def to_messages(req: MessagesRequest) -> list[Message]:
    """The system prompt and messages as the env API's (see the module's docstring)."""
    out = []
    if req.system:
        out.append(Message(role="system", content=_text(req.system, "system")))
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append(Message(role=m.role, content=m.content))
        elif m.role == "system":
            out.append(Message(role="system", content=_text(m.content, where + ".content")))
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        else:
            out += _user(m.content, where)
    return out


def _assistant(blocks: list[_Block], where: str) -> Message:
    text, calls = [], []
    for j, b in enumerate(blocks):
        if b.type == "text":
            text.append(_field(b.text, f"{where}.content[{j}].text"))
        elif b.type == "tool_use":
            place = f"{where}.content[{j}]"
            calls.append(ToolCall(id=_field(b.id, place + ".id"), name=_field(b.name, place + ".name"),
                                  arguments=arguments(b.input if b.input is not None else {}, place + ".input")))
        else:
            raise BadCall(f"{where}.content[{j}]: an assistant's {b.type!r} block is not supported (text and "
                          "tool_use are)")
    return Message(role="assistant", content="".join(text), tool_calls=calls)


def _user(blocks: list[_Block], where: str) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        place = f"{where}.content[{j}]"
        if b.type == "text":
            text.append(_field(b.text, place + ".text"))
        elif b.type == "tool_result":
            if text:  # text before a result: a user message of its own, in its place
                out.append(Message(role="user", content="".join(text)))
                text = []
            # `is_error` is accepted: the chat template has no error flag, the result's text says what failed
            out.append(Message(role="tool", tool_call_id=_field(b.tool_use_id, place + ".tool_use_id"),
                               content=_text(b.content or "", place + ".content")))
        else:
            raise BadCall(f"{place}: {b.type!r} blocks are not supported (text and tool_result are)")
    if text or not out:
        out.append(Message(role="user", content="".join(text)))
    return out


def _text(content: str | list[_Block], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, b in enumerate(content):
        if b.type != "text":
            raise BadCall(f"{where}[{j}]: only text blocks are supported here, not {b.type!r}")
        parts.append(_field(b.text, f"{where}[{j}].text"))
    return "".join(parts)


def _field(value: str | None, where: str) -> str:
    if value is None:
        raise BadCall(f"{where}: required")
    return value


# ---- replies -----------------------------------------------------------------------------------

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def _stop_reason(c: Completion) -> str:
    return "stop_sequence" if c.stop is not None else _STOP_REASONS[c.finish_reason]


def _blocks(c: Completion) -> list[dict[str, Any]]:
    """The reply's content blocks: its text (also when empty and there is no call), then its calls."""
    out: list[dict[str, Any]] = []
    if c.message.content or not c.message.tool_calls:
        out.append({"type": "text", "text": c.message.content})
    out += [{"type": "tool_use", "id": t.id, "name": t.name, "input": t.arguments} for t in c.message.tool_calls]
    return out


def _message(c: Completion, model: str, content: list[dict[str, Any]], done: bool) -> dict[str, Any]:
    return {"id": "msg_" + new_id()[:24], "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(c) if done else None, "stop_sequence": c.stop if done else None,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": len(c.completion_ids) if done else 0}}


class MessagesApi(Api):
    """`POST /v1/messages`."""

    name = "messages"

    def call(self, body: bytes, default: Sampling) -> Call:
        req = decode_request(body)
        refuse(unsupported(req))
        tools = [function_schema(t.name, t.description, t.input_schema, t.strict) for t in req.tools or []] or None
        sampling = over(default, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        max_new_tokens=req.max_tokens, stop=req.stop_sequences)
        none = req.tool_choice is not None and req.tool_choice.type == "none"
        return Call(request=req, messages=to_messages(req), tools=tools, sampling=sampling,
                    parse_tools=bool(tools) and not none, stream=bool(req.stream), model=req.model)

    def reply(self, call: Call, completions: list[Completion], tokenizer: Any) -> Any:
        (c,) = completions
        return _message(c, call.model, _blocks(c), done=True)

    def events(self, call: Call, completions: list[Completion]) -> list[bytes]:
        (c,) = completions
        out = [sse({"type": "message_start", "message": _message(c, call.model, [], done=False)}, "message_start")]
        for i, block in enumerate(_blocks(c)):
            if block["type"] == "text":
                start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
            else:  # a call's arguments in one piece of its JSON (a client joins the pieces, then parses)
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            out.append(sse({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start"))
            out.append(sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta"))
            out.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(c), "stop_sequence": c.stop},
                        "usage": {"output_tokens": len(c.completion_ids)}}, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

    def error(self, status: int, message: str, code: str | None = None) -> Any:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
