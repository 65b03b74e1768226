"""docs/envs.md's examples, as written there: the env module, the offline test, the user simulator,
the config through the real `slime-async` command, and the tables of the names a reward may take."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slime_async.env import ScriptedPolicy, run_episode
from slime_async.env.rewards import GROUP_REWARD_ARGS, REWARD_ARGS
from slime_async.types import StopReason, Task

DOC = Path(__file__).resolve().parents[2] / "docs" / "envs.md"
CLI = Path(sys.executable).with_name("slime-async")


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture
def unit_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The page's env module and config, side by side in a directory of their own."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "unit_env.py").write_text(blocks("python")[0])
    (project / "unit.yaml").write_text(blocks("yaml")[0])
    monkeypatch.syspath_prepend(str(project))
    yield project
    sys.modules.pop("unit_env", None)


def test_the_offline_test_of_the_docs_env_passes(unit_env: Path, tiny_model_dir: Path) -> None:
    script = blocks("python")[1]
    assert "asyncio.run(main())" in script  # its asserts are the test: a script that ran nothing proves nothing
    exec(compile(script, f"{DOC}:offline", "exec"), {"__name__": "docs_envs_offline"})


async def test_the_user_simulator_plays_until_found(tokenizer: Any) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(blocks("python")[2], f"{DOC}:guess", "exec"), namespace)
    task = Task(id="g", prompt="Guess.", answer=37)
    traj = await run_episode(namespace["GuessEnv"](), task, ScriptedPolicy(["50", "25", "37"], tokenizer), tokenizer)
    assert traj.stop_reason is StopReason.DONE and len(traj.turns) == 3
    assert traj.rewards == {"found": 1.0}
    prompts = [tokenizer.decode(t.prompt_ids.tolist()) for t in traj.turns]
    assert "Lower." in prompts[1] and "Higher." in prompts[2]


def test_the_docs_config_is_checked_by_the_real_command(unit_env: Path, tmp_path: Path) -> None:
    """From another directory: the env module is found next to its config (`run.python_path`)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = subprocess.run(
        [str(CLI), "config", "show", str(unit_env / "unit.yaml")],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "name: unit_env:UnitEnv" in shown.stdout and f"- {unit_env}" in shown.stdout
    bad = subprocess.run(
        [str(CLI), "config", "show", str(unit_env / "unit.yaml"), "env.args.tolerence=0.1"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    documented = next(line for line in DOC.read_text().splitlines() if line.startswith("error: env.args:"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert " ".join(bad.stderr.split()).startswith(documented.removesuffix(" ...)"))


def test_every_name_a_reward_may_take_is_in_the_docs_tables() -> None:
    rows = set(re.findall(r"^\| `(\w+)` \|", DOC.read_text(), re.MULTILINE))
    assert set(REWARD_ARGS) | set(GROUP_REWARD_ARGS) <= rows, sorted(set(REWARD_ARGS) | set(GROUP_REWARD_ARGS) - rows)
