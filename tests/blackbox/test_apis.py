"""The endpoint's other APIs (Anthropic Messages, OpenAI Responses) over real HTTP with their real SDKs,
with scripted model replies: the same conversation records the same tokens as through chat completions,
a compacted context is a new segment, and every field that cannot be honoured gets a 400 naming it.
(`test_real_agents.py` runs them against a real engine.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_endpoint import play, probe_task
from transformers import AutoTokenizer

from envs.calculator import demo_replies
from slime_async.dashboard.store import TrajectoryStore, TrajectoryWriter
from slime_async.dashboard.trajectory_view import detail
from slime_async.env import Limits
from slime_async.train.recorder import advantages_of
from slime_async.types import StopReason, Task

REPLIES = demo_replies(Task(id="c", prompt="", answer=413, metadata={"steps": ["12*34+5"]}))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def calc_task() -> Task:
    return Task(id="c", prompt="What is 12*34+5?", answer=413, metadata={})


@pytest.mark.parametrize("agent", ["anthropic_calculator", "responses_calculator"])
async def test_each_api_records_what_chat_completions_records(tokenizer: Any, agent: str) -> None:
    reference = await play(tokenizer, "openai_calculator", REPLIES, calc_task())
    task = calc_task()
    traj = await play(tokenizer, agent, REPLIES, task)
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
    assert [x.tolist() for x in traj.flat()] == [x.tolist() for x in reference.flat()]  # tokens and mask
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["new_branches"] == 0
    assert "<tool_response>413</tool_response>" in tokenizer.decode(traj.turns[1].prompt_ids.tolist())
    assert task.metadata["final"] == "The answer is 413."


@pytest.mark.parametrize("agent", ["openai_calculator", "anthropic_calculator", "responses_calculator"])
async def test_a_reply_with_text_and_a_call_echoed_back_continues_token_for_token(tokenizer: Any, agent: str) -> None:
    """A text block and a tool_use block (a message item and a function_call item) are one assistant
    message: sent back as they came, they are the message the session holds, not a rewritten history."""
    replies = ["Let me compute.\n" + REPLIES[0], REPLIES[1]]
    traj = await play(tokenizer, agent, replies, calc_task())
    assert traj.stop_reason is StopReason.DONE and traj.metrics["tool_calls"] == 1, traj.error
    assert traj.metrics["new_branches"] == 0 and len(traj.segments()) == 1


@pytest.mark.parametrize("api", ["anthropic", "responses"])
async def test_a_compacted_context_starts_a_new_segment(tokenizer: Any, api: str) -> None:
    task = Task(id="l", prompt="What is 2+3?", metadata={"api": api})
    traj = await play(tokenizer, "compacting", ["a", "b", "c"], task)
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert [t.new_branch for t in traj.turns] == [False, False, True] and traj.metrics["new_branches"] == 1
    first, second = traj.segments()
    assert tokenizer.decode(first[0].tolist()).endswith("more<|im_end|>\n<|im_start|>assistant\nb<|im_end|>")
    compacted = tokenizer.decode(second[0].tolist())  # the summary, without the old history
    assert "Summary of the work so far" in compacted and "2+3" not in compacted and compacted.endswith("c<|im_end|>")


async def test_the_dashboard_shows_a_compacted_context_as_a_new_segment(tokenizer: Any, tmp_path: Path) -> None:
    task = Task(id="l", prompt="2+3?", metadata={"api": "responses"})
    traj = await play(tokenizer, "compacting", ["a", "b", "c"], task)
    writer = TrajectoryWriter(tmp_path, tokenizer)
    writer.append(1, [traj], advantages_of([traj], "grpo"))
    store = TrajectoryStore(tmp_path)
    try:
        shown = detail(store, traj.id, tmp_path)
    finally:
        writer.close()
        store.close()
    assert [t["new_branch"] for t in shown["turns"]] == [False, False, True]  # the viewer marks it as such
    assert shown["turns"][2]["prompt_text"].startswith("<|im_start|>user\nSummary of the work so far")


def message(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


BAD_MESSAGES = [
    ("{not json", "the body is not JSON"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}, "missing required field `max_tokens`"),
    (message(output_format={"type": "json"}), "unknown field `output_format`"),
    (message(tool_choice={"type": "any"}), "tool_choice.type: only 'auto' and 'none', not 'any'"),
    (message(tool_choice={"type": "auto", "disable_parallel_tool_use": True}), "disable_parallel_tool_use"),
    (message(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking.type: 'enabled'"),
    (message(temperature=1.5), "$.temperature"),
    (message(messages=[{"role": "robot", "content": "hi"}]), "$.messages[0].role"),
    (message(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
     "context_management.edits[0].type: 'clear_tool_uses_20250919'"),
    (message(output_config={"format": {"type": "json_schema"}}), "output_config.format"),
    (message(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0]: 'image' blocks are not supported"),
    (message(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}]}]),
     "unknown field `colour`"),
    (message(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "4"}]}]),
     "messages[0].content[0].tool_use_id: required"),
    (message(system=[{"type": "document"}]), "system[0]: only text blocks"),
    (message(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "text": "hm"}]}]), "messages[1].content[0]: an assistant's 'thinking' block"),
    (message(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]),
     "the last message is the assistant's"),
]


async def test_bad_messages_get_a_400_that_names_the_field_and_the_session_goes_on(tokenizer: Any) -> None:
    fine = message(stop_sequences=["END"], system="Be brief.", thinking={"type": "adaptive"}, output_config={
        "effort": "high"}, context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    task = probe_task(*[body for body, _ in BAD_MESSAGES], fine,
                      route="messages", key_header="x-api-key")
    traj = await play(tokenizer, "probe", ["done END"], task)
    answers = task.metadata["answers"]
    assert len(answers) == len(BAD_MESSAGES) + 1
    for (body, expected), (status, answer) in zip(BAD_MESSAGES, answers, strict=False):
        assert status == 400 and expected in answer["error"]["message"], (body, answer)
        assert answer == {"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": answer["error"]["message"]}}
    status, good = answers[-1]
    assert status == 200 and good["content"] == [{"type": "text", "text": "done "}], good
    assert (good["stop_reason"], good["stop_sequence"]) == ("stop_sequence", "END")
    assert good["usage"] == {"input_tokens": len(traj.turns[0].prompt_ids),
                             "output_tokens": len(traj.turns[0].completion_ids)}
    assert traj.stop_reason is StopReason.DONE and len(traj.turns) == 1  # nothing bad was recorded
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tokenizer.decode(traj.turns[0].prompt_ids.tolist())


async def test_a_streamed_message_sends_anthropics_events_in_order(tokenizer: Any) -> None:
    tools = [{"name": "calculate", "input_schema": {"type": "object"}}]
    task = probe_task(message(stream=True, tools=tools, max_tokens=64), route="messages")
    await play(tokenizer, "probe", [REPLIES[0]], task)
    status, text = task.metadata["answers"][0]
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in text.strip().split("\n\n")]
    assert status == 200 and [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]  # fmt: skip
    assert all(name == data["type"] for name, data in events)
    assert events[1][1]["content_block"]["type"] == "tool_use" and events[1][1]["content_block"]["input"] == {}
    assert events[2][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"expression": "12*34+5"}'}
    assert events[4][1]["delta"]["stop_reason"] == "tool_use"


async def test_a_wrong_anthropic_key_is_refused_in_anthropics_shape(tokenizer: Any) -> None:
    task = probe_task(message(), route="messages", key="sk-wrong", key_header="x-api-key")
    await play(tokenizer, "probe", [], task)
    assert task.metadata["answers"] == [(401, {"type": "error", "error": {
        "type": "authentication_error", "message": "wrong API key for this session"}})]


def response(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "input": "hi", "max_output_tokens": 8, **fields}


BAD_RESPONSES = [
    ("{not json", "the body is not JSON"),
    (response(modalities=["text"]), "unknown field `modalities`"),
    (response(previous_response_id="resp_1"), "previous_response_id: responses are not stored"),
    (response(tool_choice="required"), "tool_choice: only 'auto' and 'none'"),
    (response(parallel_tool_calls=False), "parallel_tool_calls"),
    (response(reasoning={"effort": "high"}), "reasoning"),
    (response(text={"format": {"type": "json_schema", "name": "x", "schema": {}}}), "text.format.type: only 'text'"),
    (response(include=["message.output_text.logprobs"]), "include: 'message.output_text.logprobs'"),
    (response(tools=[{"type": "web_search"}]), "tools[0]: only function tools"),
    (response(max_output_tokens=0), "$.max_output_tokens"),
    (response(input=[{"role": "robot", "content": "hi"}]), "input[0].role: 'robot'"),
    (response(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]: only text parts"),
    (response(input=[{"type": "reasoning", "id": "r"}]), "input[0].type: 'reasoning' items are not supported"),
    (response(input=[{"type": "function_call_output", "output": "4"}]), "input[0].call_id"),
    (response(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"},
                     {"role": "user", "content": "x"}]), "input[0].arguments: not JSON"),
]


async def test_bad_responses_get_a_400_that_names_the_field_and_the_session_goes_on(tokenizer: Any) -> None:
    task = probe_task(*[body for body, _ in BAD_RESPONSES], response(instructions="Be brief.", store=False),
                      route="responses")
    traj = await play(tokenizer, "probe", ["done"], task)
    answers = task.metadata["answers"]
    assert len(answers) == len(BAD_RESPONSES) + 1
    for (body, expected), (status, answer) in zip(BAD_RESPONSES, answers, strict=False):
        assert status == 400 and expected in answer["error"]["message"], (body, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    status, good = answers[-1]
    assert status == 200 and good["object"] == "response" and good["status"] == "completed", good
    assert [(o["type"], o["content"][0]["text"]) for o in good["output"]] == [("message", "done")]
    assert good["usage"]["output_tokens"] == len(traj.turns[0].completion_ids)
    assert traj.stop_reason is StopReason.DONE and len(traj.turns) == 1  # nothing bad was recorded
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tokenizer.decode(traj.turns[0].prompt_ids.tolist())


async def test_a_streamed_response_sends_the_responses_events_in_order(tokenizer: Any) -> None:
    tools = [{"type": "function", "name": "calculate", "parameters": {"type": "object"}}]
    task = probe_task(response(stream=True, tools=tools, max_output_tokens=64), route="responses")
    await play(tokenizer, "probe", [REPLIES[0]], task)
    status, text = task.metadata["answers"][0]
    events = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in text.strip().split("\n\n")]
    assert status == 200 and [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[3]["delta"] == '{"expression": "12*34+5"}'
    assert events[-1]["response"]["output"][0]["name"] == "calculate"


@pytest.mark.slow  # a CLI process start (~2 s of CPU) and Claude Code's 2,800-token prompt
async def test_claude_code_runs_its_bash_tool_through_the_endpoint(tokenizer: Any) -> None:
    """A CLI coding agent from the registry (the Claude Agent SDK's bundled Claude Code), offline: its
    Bash tool runs the model's command, the output comes back as a tool result that continues the
    conversation token for token, and what the agent reports is the model's last reply."""
    call = '<tool_call>{"name": "Bash", "arguments": {"command": "echo $((12*34+5))", "description": "x"}}</tool_call>'
    task = calc_task()
    traj = await play(tokenizer, "claude_code", [call, "The answer is 413."], task,
                      limits=Limits(max_total_tokens=20_000))
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert len(traj.turns) == 2 and traj.metrics["tool_calls"] == 1 and traj.metrics["new_branches"] == 0
    assert tokenizer.decode(traj.turns[1].prompt_ids.tolist()).startswith(
        "\n<|im_start|>user\n<tool_response>413</tool_response>")  # what Bash printed
    assert task.metadata == {"result": "The answer is 413.", "is_error": False}
