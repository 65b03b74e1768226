"""calculator_agent: the calculator task as a black-box agent, an ordinary `openai` SDK program.

`run` is what a user would write without knowing this project: a chat-completions loop with one
tool, `calculate`, that the agent runs itself, and its own check of the answer as the reward. It
never sees tokens, logprobs or versions; the endpoint records them (`slime_async.agents`).
`run_anthropic` (the `anthropic` SDK, `/v1/messages`) and `run_responses` (the `openai` SDK's
Responses API) are the same agent in the other two APIs: the same tokens for the same replies.

`CalculatorAgentEnv` gives it the calculator's tasks and demonstrations (for the warm-start) and
the calculator's arguments: with `render_tools: false` (the default here, as the calculator env's
`show_tool_schemas: false`) the agent's conversation is token for token the calculator env's, so
`configs/calculator_agent.yaml` starts RL from the embedded default's own cached warm-start.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from envs.arith import ExpressionError, evaluate
from envs.calculator import CalculatorArgs, CalculatorEnv, final_number
from slime_async.agents import AgentArgs, AgentEnv
from slime_async.types import Task

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]  # fmt: skip

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = weakref.WeakKeyDictionary()


def client_for(base_url: str, api_key: str) -> AsyncOpenAI:
    """One `AsyncOpenAI` per event loop, re-pointed per episode: a new client costs ~25 ms (its TLS
    context), `with_options` ~0.04 ms and shares the connection pool."""
    loop = asyncio.get_running_loop()
    if loop not in _CLIENTS:
        _CLIENTS[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _CLIENTS[loop].with_options(base_url=base_url, api_key=api_key)


def calculate(arguments: str) -> str:
    """The agent's own tool: `{"expression": "12*34+5"}` -> "413", or an error text."""
    try:
        return str(evaluate(str(json.loads(arguments)["expression"])))
    except (json.JSONDecodeError, KeyError, TypeError, ExpressionError) as exc:
        return f"error: {exc}"


async def run(task: Task, base_url: str, api_key: str) -> float:
    """Solve `task` with the calculator; 1.0 when the last number of the final reply is the answer."""
    client = client_for(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    reply = None
    for _ in range(4):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    answer = final_number(reply.content or "") if reply is not None and not reply.tool_calls else None
    return float(answer is not None and answer == task.answer)


async def run_anthropic(task: Task, base_url: str, api_key: str) -> float:
    """`run` with the `anthropic` SDK: tool_use blocks in, tool_result blocks out."""
    tools = [{"name": "calculate", "description": TOOLS[0]["function"]["description"],
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    text = None
    async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as client:
        for _ in range(4):
            # max_tokens is required here (and honoured): configs/calculator_agent.yaml's max_new_tokens
            reply = await client.messages.create(model="policy", max_tokens=48, messages=messages, tools=tools)
            messages.append({"role": "assistant", "content": reply.content})
            calls = [b for b in reply.content if b.type == "tool_use"]
            text = None if calls else "".join(b.text for b in reply.content if b.type == "text")
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": calculate(json.dumps(c.input))}
                for c in calls]})  # fmt: skip
    answer = final_number(text) if text is not None else None
    return float(answer is not None and answer == task.answer)


async def run_responses(task: Task, base_url: str, api_key: str) -> float:
    """`run` with the Responses API: function_call items in, function_call_output items out."""
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    items: list[Any] = [{"role": "user", "content": task.prompt}]
    text = None
    client = client_for(base_url, api_key)
    for _ in range(4):
        response = await client.responses.create(model="policy", input=items, tools=tools)
        items += response.output
        calls = [o for o in response.output if o.type == "function_call"]
        text = None if calls else response.output_text
        if not calls:
            break
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": calculate(c.arguments)}
                  for c in calls]
    answer = final_number(text) if text is not None else None
    return float(answer is not None and answer == task.answer)


class CalculatorAgentArgs(CalculatorArgs):
    """The calculator's arguments and `AgentArgs`' two (msgspec Structs take fields from one base)."""

    agent: str = "envs.calculator_agent:run"
    """As `AgentArgs.agent`: another agent may solve the same tasks."""
    render_tools: bool = False
    """As `AgentArgs.render_tools`."""

    __post_init__ = AgentArgs.__post_init__


class CalculatorAgentEnv(AgentEnv):
    """The calculator's tasks and demonstrations, solved by the agent `args.agent` (default `run`)."""

    Args = CalculatorAgentArgs
    args: CalculatorAgentArgs

    @classmethod
    def tasks(cls, args: CalculatorAgentArgs, split: Any) -> list[Task]:  # type: ignore[override]
        return CalculatorEnv.tasks(args, split)

    @classmethod
    def demonstration(cls, args: CalculatorAgentArgs, task: Task) -> list[str]:  # type: ignore[override]
        return CalculatorEnv.demonstration(args, task)
