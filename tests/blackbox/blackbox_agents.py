"""Agent programs the tests train through the endpoint, named in env args as `blackbox_agents:NAME`.

They are what users write: plain HTTP, the `openai` SDK (async and sync; chat completions and
responses), the OpenAI Agents SDK, the `anthropic` SDK.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from typing import Any

import aiohttp
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI, OpenAI

from envs.calculator_agent import TOOLS, calculate
from slime_async.types import Task

ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (t["function"] for t in TOOLS)]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


async def probe(task: Task, base_url: str, api_key: str) -> None:
    """Sends `task.metadata["requests"]` as they are (JSON values, or raw strings as bodies) to
    `task.metadata["route"]` (default chat/completions) and records each answer's status and JSON
    (or its SSE text) in `task.metadata["answers"]`."""
    answers = task.metadata["answers"]
    key = task.metadata.get("key", api_key)
    header = task.metadata.get("key_header", "Authorization")  # Anthropic's clients send x-api-key
    headers = {header: f"Bearer {key}" if header == "Authorization" else key}
    url = task.metadata.get("url", base_url) + "/" + task.metadata.get("route", "chat/completions")
    async with aiohttp.ClientSession() as http:
        for body in task.metadata["requests"]:
            kwargs: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
            async with http.post(url, headers=headers, **kwargs) as resp:
                sse = resp.content_type == "text/event-stream"
                answers.append((resp.status, await resp.text() if sse else await resp.json(content_type=None)))


async def openai_calculator(task: Task, base_url: str, api_key: str) -> float:
    """The calculator loop with a fresh `AsyncOpenAI` client; the conversation kept in metadata."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(3):
            reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                          temperature=0.0)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            messages += [{"role": "tool", "tool_call_id": c.id, "content": calculate(c.function.arguments)}
                         for c in reply.tool_calls]
    task.metadata["messages"] = messages
    return 1.0


async def streaming_calculator(task: Task, base_url: str, api_key: str) -> float:
    """The first call twice, streamed and not: the test compares what the SDK assembled."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": task.prompt}]
        plain = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                      temperature=0.0)).choices[0]
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                      temperature=0.0, stream=True,
                                                      stream_options={"include_usage": True})
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:
                    entry = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
                    entry["name"] += c.function.name or ""
                    entry["arguments"] += c.function.arguments or ""
                finish = choice.finish_reason or finish
    task.metadata["plain"] = {"content": plain.message.content or "", "finish": plain.finish_reason,
                              "calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                        for c in plain.message.tool_calls or []]}
    task.metadata["streamed"] = {"content": content, "finish": finish, "calls": list(calls.values()),
                                 "usage": usage.model_dump() if usage else None}
    return 1.0


def sync_calculator(task: Task, base_url: str, api_key: str) -> float:
    """A plain `def` with the synchronous client: it runs in a thread."""
    with OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}],
                                               tools=TOOLS, temperature=0.0).choices[0].message
    return 0.5 if reply.tool_calls else 0.25


async def rewriting(task: Task, base_url: str, api_key: str) -> None:
    """The second call with its history edited (the first reply replaced): a new segment, which the
    third call continues."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        first = [{"role": "user", "content": task.prompt}]
        await client.chat.completions.create(model="policy", messages=first, max_tokens=4)
        edited = [*first, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "again"}]
        reply = (await client.chat.completions.create(model="policy", messages=edited, max_tokens=4)).choices[0]
        kept = [*edited, reply.message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="policy", messages=kept, max_tokens=4)


async def two_samples(task: Task, base_url: str, api_key: str) -> None:
    """One call with n=2, then a continuation of the first sample."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        first = [{"role": "user", "content": task.prompt}]
        out = await client.chat.completions.create(model="policy", messages=first, max_tokens=4, n=2)
        task.metadata["choices"] = len(out.choices)
        kept = [*first, out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="policy", messages=kept, max_tokens=4)


async def chatty(task: Task, base_url: str, api_key: str) -> None:
    """Keeps calling until the episode refuses; records the refusal."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        for _ in range(100):
            try:
                reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0]
            except Exception as exc:
                task.metadata["refusal"] = str(exc)
                raise
            messages += [reply.message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]


async def crashing(task: Task, base_url: str, api_key: str) -> float:
    task.metadata["base_url"], task.metadata["key"] = base_url, api_key
    raise RuntimeError("the agent fell over")


async def hanging(task: Task, base_url: str, api_key: str) -> float:
    task.metadata["base_url"], task.metadata["key"] = base_url, api_key
    await asyncio.Event().wait()
    return 1.0


async def returns_text(task: Task, base_url: str, api_key: str) -> Any:
    return "great"


async def agents_sdk_calculator(task: Task, base_url: str, api_key: str) -> float:
    """The calculator as an OpenAI Agents SDK agent: a function tool, `Runner.run`, the chat
    completions model pointed at the episode's endpoint."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # nothing leaves the machine

    @function_tool
    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calculate(json.dumps({"expression": expression}))

    calculate_tool.name = "calculate"
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", tools=[calculate_tool],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, task.prompt, max_turns=3)
    finally:
        await client.close()
    task.metadata["final_output"] = str(result.final_output)
    return 1.0


async def anthropic_calculator(task: Task, base_url: str, api_key: str) -> float:
    """The calculator loop with the `anthropic` SDK: tool_use blocks in, tool_result blocks out."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as client:
        for _ in range(3):
            reply = await client.messages.create(model="policy", max_tokens=48, messages=messages,
                                                 tools=ANTHROPIC_TOOLS)
            messages.append({"role": "assistant", "content": reply.content})
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": calculate(json.dumps(b.input))}
                for b in calls]})  # fmt: skip
    task.metadata["stop_reason"] = reply.stop_reason
    task.metadata["final"] = "".join(b.text for b in reply.content if b.type == "text")
    return 1.0


async def anthropic_streaming(task: Task, base_url: str, api_key: str) -> float:
    """The first call twice, plain and streamed (the SDK's `messages.stream` assembles the events)."""
    messages = [{"role": "user", "content": task.prompt}]
    async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as client:
        plain = await client.messages.create(model="policy", max_tokens=48, messages=messages, tools=ANTHROPIC_TOOLS)
        events = []
        async with client.messages.stream(model="policy", max_tokens=48, messages=messages,
                                          tools=ANTHROPIC_TOOLS) as stream:
            async for event in stream:
                events.append(event.type)
            streamed = await stream.get_final_message()
    task.metadata["plain"], task.metadata["streamed"] = plain.model_dump(), streamed.model_dump()
    task.metadata["events"] = events
    return 1.0


async def responses_calculator(task: Task, base_url: str, api_key: str) -> float:
    """The calculator loop with the Responses API: function_call items in, function_call_output out."""
    items: list[Any] = [{"role": "user", "content": task.prompt}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(3):
            response = await client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
            items += response.output
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                break
            items += [{"type": "function_call_output", "call_id": c.call_id, "output": calculate(c.arguments)}
                      for c in calls]
    task.metadata["status"], task.metadata["final"] = response.status, response.output_text
    return 1.0


async def responses_streaming(task: Task, base_url: str, api_key: str) -> float:
    """The first call twice, plain and streamed (the SDK's `responses.stream` assembles the events)."""
    items = [{"role": "user", "content": task.prompt}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        plain = await client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
        events = []
        async with client.responses.stream(model="policy", input=items, tools=RESPONSES_TOOLS) as stream:
            async for event in stream:
                events.append(event.type)
            streamed = await stream.get_final_response()
    task.metadata["plain"], task.metadata["streamed"] = plain.model_dump(), streamed.model_dump()
    task.metadata["events"] = events
    return 1.0


async def compacting(task: Task, base_url: str, api_key: str) -> None:
    """A long-horizon harness in each API (`task.metadata["api"]`): two calls, then its context
    compacted into a summary (the history rewritten), then one more call on the compacted context."""
    api = task.metadata["api"]
    history: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    summary = [{"role": "user", "content": "Summary of the work so far: nothing yet. Go on."}]
    if api == "anthropic":
        async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as client:
            for _ in range(2):
                reply = await client.messages.create(model="policy", max_tokens=4, messages=history)
                history += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "more"}]
            await client.messages.create(model="policy", max_tokens=4, messages=summary)
    else:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for _ in range(2):
                response = await client.responses.create(model="policy", input=history, max_output_tokens=4)
                history += [*response.output, {"role": "user", "content": "more"}]
            await client.responses.create(model="policy", input=summary, max_output_tokens=4)


async def claude_code(task: Task, base_url: str, api_key: str) -> float:
    """The Claude Agent SDK (`query`), which runs the Claude Code CLI bundled in its wheel: a CLI coding
    agent, offline, its one tool Bash, speaking Anthropic's Messages API (streamed) to the endpoint."""
    from claude_agent_sdk import ClaudeAgentOptions, ResultMessage, query

    with tempfile.TemporaryDirectory() as home:
        env = {"ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key, "HOME": home,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # nothing but the endpoint
        options = ClaudeAgentOptions(model="policy", tools=["Bash"], allowed_tools=["Bash"], max_turns=3, cwd=home,
                                     system_prompt="Compute with Bash, then answer.", env=env)
        async for message in query(prompt=task.prompt, options=options):
            if isinstance(message, ResultMessage):
                task.metadata["result"], task.metadata["is_error"] = message.result, message.is_error
    return 1.0
