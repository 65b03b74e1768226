"""Tool-call parsers: the model's reply text → content, tool calls and parse errors.

A parser is anything with `parse(text) -> ParsedReply` (the `ToolCallParser` protocol), so a
model family with another format (Llama's JSON, Mistral's `[TOOL_CALLS]`) plugs in without
touching the episode loop. `HermesParser` reads Qwen/Hermes `<tool_call>{...}</tool_call>`.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

import msgspec

from slime_async.types import ToolCall


class ParsedReply(msgspec.Struct, kw_only=True):
    """One assistant reply, understood."""

    content: str
    """The reply's text without its tool-call blocks."""
    tool_calls: list[ToolCall] = []
    """Well-formed calls, in order (their arguments are not yet checked against any schema)."""
    errors: list[str] = []
    """One line per malformed call; non-empty means the parse-error policy applies."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedReply: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per reply.

    Calls inside `<think>...</think>` (or after an unclosed `<think>`) are reasoning, not calls,
    and are ignored. `arguments` may be an object or a JSON string holding one (some models emit
    the latter); a missing `arguments` means `{}`.
    """

    def __init__(
        self,
        open_tag: str = "<tool_call>",
        close_tag: str = "</tool_call>",
        think: tuple[str, str] = ("<think>", "</think>"),
    ) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._think = re.compile(re.escape(think[0]) + r".*?(?:" + re.escape(think[1]) + r"|\Z)", re.DOTALL)
        self._block = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content_parts: list[str] = []
        pos = 0
        for segment, is_think in self._segments(text):
            if is_think:
                content_parts.append(segment)
                continue
            pos = 0
            for m in self._block.finditer(segment):
                content_parts.append(segment[pos : m.start()])
                pos = m.end()
                index = len(calls) + len(errors) + 1
                if not m.group(0).endswith(self.close_tag):
                    errors.append(f"tool call {index}: {self.open_tag} without {self.close_tag}")
                    continue
                call, error = self._call(m.group(1), index)
                if call is not None:
                    calls.append(call)
                else:
                    errors.append(error)
            content_parts.append(segment[pos:])
        return ParsedReply(content="".join(content_parts).strip(), tool_calls=calls, errors=errors)

    def format(self, content: str, calls: list[ToolCall]) -> str:
        """The reply text that says `content` and makes `calls`, written the way the tiny model's
        chat template renders an assistant message (so a scripted reply and its re-rendering agree)."""
        out = content
        for i, call in enumerate(calls):
            body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            out += ("\n" if content or i else "") + self.open_tag + body + self.close_tag
        return out

    def _segments(self, text: str) -> list[tuple[str, bool]]:
        out, pos = [], 0
        for m in self._think.finditer(text):
            out.append((text[pos : m.start()], False))
            out.append((m.group(0), True))
            pos = m.end()
        out.append((text[pos:], False))
        return out

    @staticmethod
    def _call(body: str, index: int) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call {index}: invalid JSON ({exc.msg} at character {exc.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None, f'tool call {index}: expected {{"name": "...", "arguments": {{...}}}}'
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None, f"tool call {index}: arguments is a string that is not JSON"
        if not isinstance(args, dict):
            return None, f"tool call {index}: arguments must be a JSON object"
        return ToolCall(name=obj["name"], arguments=args), ""
