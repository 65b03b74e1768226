"""docs/agents.md's agent and config, as written there: the agent solves a task through the endpoint."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from slime_async.agents import close_shared_server
from slime_async.config import load_config
from slime_async.data import build_envs, build_tasks
from slime_async.env import ScriptedPolicy, run_episode
from slime_async.types import StopReason

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


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
