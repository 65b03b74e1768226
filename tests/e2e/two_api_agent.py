"""The bundled calculator agent in two APIs at once, for one e2e run that trains both: tasks of even id
(the calculator's ids are hex) go to `run` (the `openai` SDK, /v1/chat/completions), odd ones to
`run_anthropic` (the `anthropic` SDK, /v1/messages). Named in env args as `two_api_agent:by_task_id`,
with this directory on `run.python_path` (the run's processes import it from there)."""

from __future__ import annotations

from envs.calculator_agent import run, run_anthropic
from slime_async.types import Task


def uses_messages_api(task_id: str) -> bool:
    """Whether `by_task_id` sends this task through the `anthropic` SDK."""
    return int(task_id, 16) % 2 == 1


async def by_task_id(task: Task, base_url: str, api_key: str) -> float:
    agent = run_anthropic if uses_messages_api(task.id) else run
    return await agent(task, base_url, api_key)
