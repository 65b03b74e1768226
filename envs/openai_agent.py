"""openai_agent: train any agent program written against the OpenAI API (`slime_async.agents`).

    env:
      name: envs.openai_agent:AgentEnv
      args: {agent: my_package.my_agent:run}
    data: {source: jsonl, path: tasks.jsonl}

`run(task, base_url, api_key)` makes its model calls at `base_url` with `api_key` and returns its
reward (or None). An agent that is a program of its own (its own virtualenv): `CommandAgentEnv`,
`args: {command: [/path/to/venv/bin/python, my_agent.py]}`. See docs/agents.md.
"""

from slime_async.agents import AgentArgs, AgentEnv, CommandAgentEnv, CommandArgs

__all__ = ["AgentArgs", "AgentEnv", "CommandAgentEnv", "CommandArgs"]
