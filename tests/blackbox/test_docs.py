"""docs/agents.md's agents and configs, as written there: each agent solves a task through the endpoint."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from slime_async.agents import AgentEnv, CommandAgentEnv, close_shared_server
from slime_async.config import load_config
from slime_async.data import build_envs, build_tasks
from slime_async.env import ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
TASK = Task(id="d", prompt="What is 12*34+5?", answer=413, metadata={})


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.DOTALL)


async def test_the_docs_agent_trains_from_the_docs_config(tmp_path: Path, tiny_model_dir: Path,
                                                         monkeypatch: object) -> None:
    (tmp_path / "my_agent.py").write_text(blocks("python")[0])
    (tmp_path / "my_agent.yaml").write_text(blocks("yaml")[0])
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "What is 12*34+5?", "label": 413}\n')
    assert len(blocks("python")[0].strip().splitlines()) <= 30  # the promised size, give or take imports
    monkeypatch.chdir(tmp_path)  # type: ignore[attr-defined]
    monkeypatch.syspath_prepend(str(tmp_path))  # type: ignore[attr-defined]
    cfg = load_config(tmp_path / "my_agent.yaml")
    envs = build_envs(cfg)
    task = next(iter(build_tasks(cfg, envs)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    replies = ['<tool_call>{"name": "calculate", "arguments": {"expression": "12*34+5"}}</tool_call>',
               "The answer is 413."]
    try:
        traj = await run_episode(envs.new(), task, ScriptedPolicy(replies, tokenizer), tokenizer)
    finally:
        await close_shared_server()
        sys.modules.pop("my_agent", None)
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
    assert "<tool_response>413</tool_response>" in tokenizer.decode(traj.turns[1].prompt_ids.tolist())
    assert msgspec.to_builtins(cfg.env.args) == {"agent": "my_agent:run"}


CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12*34+5"}}</tool_call>'
FRAMEWORKS = {  # each example, the model's (scripted) replies, and how its tool's result reached the model
    "my_anthropic_agent": ([CALL, "The answer is 413."], "<tool_response>413</tool_response>"),
    "my_responses_agent": ([CALL, "The answer is 413."], "<tool_response>413</tool_response>"),
    "my_langgraph_agent": ([CALL, "The answer is 413."], "<tool_response>413</tool_response>"),
    "my_smolagents_agent": ([CALL, '<tool_call>{"name": "final_answer", "arguments": {"answer": "413"}}</tool_call>'],
                            "Observation:\n413"),
}


def named(name: str) -> str:
    (block,) = [b for b in blocks("python") if b.startswith(f"# {name}")]
    return block


@pytest.mark.parametrize("name", list(FRAMEWORKS))
async def test_each_frameworks_example_solves_a_task_through_the_endpoint(
        name: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    (tmp_path / f"{name}.py").write_text(named(f"{name}.py"))
    assert len(named(f"{name}.py").strip().splitlines()) <= 30
    monkeypatch.syspath_prepend(str(tmp_path))
    replies, tool_result = FRAMEWORKS[name]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = AgentEnv(AgentEnv.Args(agent=f"{name}:run"))
    try:
        traj = await run_episode(env, TASK, ScriptedPolicy(replies, tokenizer), tokenizer)
    finally:
        await close_shared_server()
        sys.modules.pop(name, None)
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
    assert len(traj.turns) == 2 and tool_result in tokenizer.decode(traj.turns[1].prompt_ids.tolist())


async def test_the_docs_program_agent_runs_as_a_program_of_its_own(tmp_path: Path, tiny_model_dir: Path) -> None:
    """agent_main.py with this project's interpreter (it has `openai`); test_command_agent.py runs one in a
    fresh, empty virtualenv. The docs config names the same env."""
    program = tmp_path / "agent_main.py"
    program.write_text(named("agent_main.py"))
    (config,) = [b for b in blocks("yaml") if b.startswith("# my_command_agent.yaml")]
    (tmp_path / "c.yaml").write_text(config)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "What is 12*34+5?", "label": 413}\n')
    assert msgspec.to_builtins(load_config(tmp_path / "c.yaml").env.args)["command"][1] == "agent_main.py"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = CommandAgentEnv(CommandAgentEnv.Args(command=[sys.executable, str(program)]))
    try:
        traj = await run_episode(env, TASK, ScriptedPolicy(["The answer is 413."], tokenizer), tokenizer)
    finally:
        await close_shared_server()
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
