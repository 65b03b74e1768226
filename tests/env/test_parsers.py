"""The Hermes tool-call parser: several calls per reply, calls inside <think> ignored, errors named."""

from __future__ import annotations

import pytest

from slime_async.env import HermesParser
from slime_async.types import ToolCall

P = HermesParser()


def test_plain_reply_has_no_calls() -> None:
    r = P.parse("The answer is 42.")
    assert (r.content, r.tool_calls, r.errors) == ("The answer is 42.", [], [])


def test_several_calls_in_order() -> None:
    text = (
        'Let me see.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    r = P.parse(text)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("a", {"x": 1}), ("b", {"y": [2]}), ("c", {})]
    assert r.content == "Let me see."
    assert r.errors == []
    assert len({c.id for c in r.tool_calls}) == 3


def test_calls_inside_think_are_ignored() -> None:
    text = '<think>maybe <tool_call>{"name": "no"}</tool_call></think><tool_call>{"name": "yes"}</tool_call>'
    r = P.parse(text)
    assert [c.name for c in r.tool_calls] == ["yes"]
    assert r.content == '<think>maybe <tool_call>{"name": "no"}</tool_call></think>'
    unclosed = P.parse('<think>still thinking <tool_call>{"name": "no"}</tool_call>')
    assert unclosed.tool_calls == [] and unclosed.errors == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("{bad json}", "invalid JSON"),
        ('{"arguments": {}}', 'expected {"name"'),
        ('{"name": ""}', 'expected {"name"'),
        ('["a"]', 'expected {"name"'),
        ('{"name": "a", "arguments": [1]}', "arguments must be a JSON object"),
        ('{"name": "a", "arguments": "not json"}', "arguments is a string that is not JSON"),
    ],
)
def test_malformed_calls_are_errors(body: str, error: str) -> None:
    r = P.parse(f'<tool_call>{{"name": "ok"}}</tool_call><tool_call>{body}</tool_call>')
    assert [c.name for c in r.tool_calls] == ["ok"]  # the good call still counts
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 2: ") and error in r.errors[0]


def test_unterminated_call_is_an_error() -> None:
    r = P.parse('text <tool_call>{"name": "a", "argu')
    assert r.tool_calls == []
    assert r.errors == ["tool call 1: <tool_call> without </tool_call>"]


def test_format_round_trips() -> None:
    calls = [ToolCall(name="calculate", arguments={"expression": "2*3"}), ToolCall(name="b", arguments={})]
    for content in ("", "Sure."):
        r = P.parse(P.format(content, calls))
        assert r.content == content
        assert [(c.name, c.arguments) for c in r.tool_calls] == [(c.name, c.arguments) for c in calls]
