"""Checks before any process starts, through the real `slime-async` entry point: a misspelled env
module, class or argument, a tool parameter without a type hint, a reward asking for an unknown
argument: one line on stderr, exit code 2, the nearest existing name, and no run started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("slime-async")

MODULE = '''
from slime_async.env import Env, EnvArgs, reward, tool


class UnitArgs(EnvArgs):
    tolerance: float = 0.01


class UnitEnv(Env):
    Args = UnitArgs

    @tool
    def convert(self, value: float, unit: str) -> str:
        """Convert."""
        return str(value)

    @reward
    def correct(self, completion: str) -> float:
        return 1.0


def keep_all(group):
    return True


def advantages(rewards, group_index, mask):
    return rewards
'''


def project(tmp_path: Path, module: str = MODULE) -> Path:
    """An env module next to its config, in a directory that is not the current one."""
    d = tmp_path / "project"
    d.mkdir(exist_ok=True)
    (d / "unit_env.py").write_text(module)
    (d / "unit.yaml").write_text(f"env:\n  name: unit_env:UnitEnv\nrun:\n  dir: {tmp_path / 'runs'}\n")
    return d / "unit.yaml"


def slime_async(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def assert_one_line(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    line = result.stderr.strip()
    for text in expected:
        assert text in line, line
    assert "Traceback" not in result.stdout + result.stderr


def test_a_module_next_to_its_config_is_found_from_anywhere(tmp_path: Path) -> None:
    result = slime_async(tmp_path, "config", "show", str(project(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "name: unit_env:UnitEnv" in result.stdout


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("env.name=unit_env:UnitEnvv", ["env.name: module 'unit_env' has no 'UnitEnvv'; did you mean 'UnitEnv'?"]),
        (
            "env.name=unit_envv:UnitEnv",
            ["env.name: cannot import module 'unit_envv'", "did you mean 'unit_env'?", "run.python_path"],
        ),
        ("env.name=envs.calculater:CalculatorEnv", ["did you mean 'envs.calculator'?"]),
        ("env.args.tolerence=0.1", ["env.args: Object contains unknown field `tolerence`; did you mean 'tolerance'?"]),
        ("env.args.limits.max_turn=2", ["unknown field `max_turn`", "did you mean 'max_turns'?"]),
        ("data.envs={a: {name: unit_env:UnitEnvv}}", ["data.envs.a: env.name:", "did you mean 'UnitEnv'?"]),
        ("rollout.group_filter=unit_env:keep_al", ["rollout.group_filter: module 'unit_env' has no 'keep_al'",
                                                   "did you mean 'keep_all'?"]),
        ("train.advantage_fn=unit_env:advantagez", ["train.advantage_fn:", "did you mean 'advantages'?"]),
        ("train.policy_loss_fn=unit_lossez:loss", ["train.policy_loss_fn: cannot import module 'unit_lossez'"]),
    ],
)
def test_config_show_names_the_misspelling(tmp_path: Path, override: str, expected: list[str]) -> None:
    assert_one_line(slime_async(tmp_path, "config", "show", str(project(tmp_path)), override), *expected)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "value: float, unit",
            "value, unit",
            ["unit_env:UnitEnv: @tool UnitEnv.convert: parameter 'value' has no type hint"],
        ),
        (
            "completion: str",
            "completions: str",
            ["@reward UnitEnv.correct: unknown argument(s) ['completions']; did you mean 'completion'"],
        ),
        (
            "from slime_async",
            "import no_such_dependency_zz\nfrom slime_async",
            ["module 'unit_env' imports 'no_such_dependency_zz', which is not installed"],
        ),
        (
            "class UnitArgs",
            "1 / 0\nclass UnitArgs",
            ["importing 'unit_env' failed:", "unit_env.py:", "ZeroDivisionError"],
        ),
    ],
)
def test_broken_env_code_is_one_line(tmp_path: Path, old: str, new: str, expected: list[str]) -> None:
    config = project(tmp_path, MODULE.replace(old, new))
    assert_one_line(slime_async(tmp_path, "config", "show", str(config)), *expected)


def test_train_and_rollout_refuse_before_starting_anything(tmp_path: Path) -> None:
    config = str(project(tmp_path))
    trained = slime_async(tmp_path, "train", config, "env.name=unit_env:UnitEnvv")
    assert_one_line(trained, "did you mean 'UnitEnv'?")
    assert "starting" not in trained.stdout and not (tmp_path / "runs").exists()  # no run directory, no process
    out = tmp_path / "t.jsonl"
    rolled = slime_async(tmp_path, "rollout", config, "--out", str(out), "env.args.tolerence=0.1")
    assert_one_line(rolled, "did you mean 'tolerance'?")
    assert not out.exists()
