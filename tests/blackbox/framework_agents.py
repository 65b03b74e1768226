"""Agents built with agent frameworks, unchanged but for the endpoint's URL: a LangGraph ReAct agent
(`langchain-openai`) and a smolagents `ToolCallingAgent`, each with the calculator as its tool.
Named in env args as `framework_agents:NAME`."""

from __future__ import annotations

import json

from envs.calculator_agent import calculate as calculate_json
from slime_async.types import Task


def _calculate(expression: str) -> str:
    return calculate_json(json.dumps({"expression": expression}))


async def langgraph_calculator(task: Task, base_url: str, api_key: str) -> float:
    """`langgraph.prebuilt.create_react_agent` over `ChatOpenAI`: model, tool, model, until no call."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _calculate(expression)

    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0)
    agent = create_react_agent(model, [calculate])
    result = await agent.ainvoke({"messages": [{"role": "user", "content": task.prompt}]}, {"recursion_limit": 6})
    task.metadata["messages"] = [(m.type, m.content) for m in result["messages"]]
    return 1.0


def smolagents_calculator(task: Task, base_url: str, api_key: str) -> float:
    """smolagents' `ToolCallingAgent` over `OpenAIServerModel` (synchronous: it runs in a thread), with a
    short system prompt of its own (smolagents' default is longer than the tiny model's context).
    smolagents replays its memory as text (calls as "Calling tools: ...", results as user messages),
    not as the reply it got: each call is a rewritten history, a new segment."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12*34+5.
        """
        return _calculate(expression)

    # smolagents asks for tool_choice "required", which the endpoint cannot enforce (400): "auto" instead
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key, tool_choice="auto",
                              client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[calculate], model=model, max_steps=1, verbosity_level=0)
    agent.prompt_templates["system_prompt"] = "Use the tools."
    task.metadata["output"] = str(agent.run(task.prompt))
    task.metadata["steps"] = [type(s).__name__ for s in agent.memory.steps]
    return 1.0
