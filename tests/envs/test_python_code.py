"""python_code: hidden tests in the real sandbox decide the reward; wrong, hanging or cheating
solutions score 0."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from envs.python_code import PythonCodeArgs, PythonCodeEnv, demo_reply, extract_code
from slime_async.env import HermesParser, ScriptedPolicy, run_episode
from slime_async.env.sandbox import SandboxLimits
from slime_async.types import StopReason, Task, ToolCall

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")


def tasks(split: str = "train", n: int = 10) -> list[Task]:
    return PythonCodeEnv.tasks(PythonCodeArgs(num_train=n, num_eval=n), split)  # type: ignore[arg-type]


async def play(tokenizer: Any, task: Task, replies: list[str]) -> Any:
    env = PythonCodeEnv(PythonCodeArgs(sandbox=SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256)))
    return await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer)


def run_call(code: str) -> str:
    return HermesParser().format("", [ToolCall(name="run_python", arguments={"code": code})])


async def test_reference_solutions_pass_every_family(tokenizer: Any) -> None:
    families: dict[str, Task] = {}
    for task in tasks("train", 40):
        families.setdefault(task.metadata["function"], task)
    assert len(families) == 5
    for task in families.values():
        traj = await play(tokenizer, task, [demo_reply(task)])
        assert traj.stop_reason is StopReason.DONE
        assert traj.rewards == {"tests_pass": 1.0}, (task.prompt, traj.error)
        assert traj.metrics["tests_passed_fraction"] == 1.0


async def test_tool_runs_code_in_the_sandbox(tokenizer: Any) -> None:
    task = tasks()[0]
    traj = await play(tokenizer, task, [run_call("import os\nprint(os.getuid() == 0, 6 * 7)"), demo_reply(task)])
    assert traj.reward == 1.0 and traj.metrics["tool_calls"] == 1
    response = tokenizer.decode(traj.turns[1].prompt_ids)
    assert "exit code 0" in response and "42" in response


@pytest.mark.parametrize(
    "solution",
    [
        "def {name}(*args):\n    return None\n",  # wrong
        "def {name}(*args):\n    while True:\n        pass\n",  # hangs: killed, scored 0
        "import json\nprint(json.dumps([['ok', 0]] * 5))\ndef {name}(*args):\n    return 0\n",  # fakes the output
        "def {name}(:\n",  # does not compile
        "",  # no code at all
    ],
)
async def test_bad_solutions_score_zero(tokenizer: Any, solution: str) -> None:
    task = tasks()[0]
    code = solution.format(name=task.metadata["function"])
    traj = await play(tokenizer, task, [f"```python\n{code}```"])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 0.0
    assert traj.metrics["reward_errors"] == 0  # a failing solution is not a verifier error


async def test_partial_credit_is_a_metric_only(tokenizer: Any) -> None:
    task = next(t for t in tasks("train", 40) if t.metadata["function"] == "count_multiples")
    first_input = task.metadata["inputs"][0][0]
    k = int(task.prompt.rsplit(" ", 1)[-1].rstrip("."))
    code = f"def count_multiples(n):\n    return n // {k} if n == {first_input} else -1\n"
    traj = await play(tokenizer, task, [f"```python\n{code}```"])
    assert traj.reward == 0.0
    expected = task.metadata["expected"]
    assert traj.metrics["tests_passed_fraction"] == sum(e == expected[0] for e in expected) / len(expected)


def test_tasks_deterministic_and_split() -> None:
    assert tasks(n=20) == tasks(n=20)
    train, held_out = {t.prompt for t in tasks("train", 200)}, {t.prompt for t in tasks("eval", 20)}
    assert held_out and not train & held_out
    assert all(json.dumps(t.metadata["expected"]) for t in tasks(n=5))


def test_extract_code() -> None:
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"
