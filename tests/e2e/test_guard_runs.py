"""Loud failures end to end: `slime-async rollout` and `slime-async train` (every part a real process)
on an env of the user's, next to its config outside the checkout. A reward that raises, or groups
without a learning signal, stop the run with the reason and the first error, counted per name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("slime-async")

MODULE = """
from slime_async.env import Env, reward
from slime_async.types import Task


class UserEnv(Env):
    @classmethod
    def tasks(cls, args, split):
        return [Task(id=f"{split}-{i}", prompt=f"What is {i}+1?", answer=i + 1) for i in range(64)]

    @reward
    def correct(self, completion: str) -> float:
        MODE
"""


def project(tmp_path: Path, body: str, *settings: str) -> Path:
    """`user_env.py` beside `user.yaml` in a directory of its own; the commands run from the checkout."""
    d = tmp_path / "project"
    d.mkdir()
    (d / "user_env.py").write_text(MODULE.replace("MODE", body))
    (d / "user.yaml").write_text(
        "\n".join(
            [
                "env: {name: 'user_env:UserEnv', args: {limits: {max_turns: 1}}}",
                f"run: {{name: guarded, dir: '{tmp_path / 'runs'}'}}",
                "rollout: {batch_size: 8, group_size: 4, sampling: {max_new_tokens: 8}}",
                "train: {steps: 100}",
                "log: {tensorboard: false, sample_every: 0}",
                *settings,
            ]
        )
        + "\n"
    )
    return d / "user.yaml"


def test_rollout_stops_when_most_episodes_fail(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = project(tmp_path, 'raise ValueError("unit table missing")', "")
    out = tmp_path / "t.jsonl"
    done = subprocess.run(
        [str(CLI), "rollout", str(config), "--groups", "8", "--out", str(out), "rollout.guard.window=8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    stderr = " ".join(done.stderr.split())
    assert "stopped: 8 of the latest 8 episodes failed" in stderr
    assert "first error: reward correct failed: ValueError: unit table missing" in stderr
    assert "reward correct: " in done.stdout and "(first: ValueError: unit table missing)" in done.stdout
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept and all(t["errors"] == {"reward correct": "ValueError: unit table missing"} for t in kept)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "settings", "rule", "said"),
    [
        (
            'raise ValueError("unit table missing")',
            "rollout.guard.window=16",
            "failures",
            "first error: reward correct failed: ValueError: unit table missing",
        ),
        ("return 1.0", "rollout.guard.on_no_signal=stop", "no_signal", "no learning signal: the latest"),
    ],
)
def test_train_stops_a_run_that_cannot_learn(
    tmp_path: Path, tiny_model_dir: Path, body: str, settings: str, rule: str, said: str
) -> None:
    config = project(tmp_path, body)
    done = subprocess.run(
        [str(CLI), "train", str(config), settings, "rollout.guard.no_signal_steps=1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert said in " ".join(done.stderr.split())
    run = tmp_path / "runs" / "guarded"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"]["rule"] == rule and summary["steps"] < 100
    if rule == "failures":
        assert summary["errors"]["counts"]["reward correct"] >= 16
        assert summary["errors"]["first"]["reward correct"] == "ValueError: unit table missing"
        assert "reward correct: " in done.stdout  # the summary table's errors row
    footer = next(line for line in done.stdout.splitlines() if line.startswith("run directory"))
    listed = footer.partition("(")[2].rstrip(")").split(", ")
    assert "summary.json" in listed and all((run / name).exists() for name in listed)
    assert "samples.md" not in listed and "tensorboard/" not in listed  # log.sample_every 0, no tensorboard
