"""`slime-async train` with `train.distill`, end to end: the launcher starts the teacher's embedded engine,
the rollout worker has it score every group over HTTP, the trainer trains the reverse-KL term."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_train import REPO, processes_mentioning, train_command

pytestmark = pytest.mark.slow


def test_a_run_distills_from_a_teacher_engine_it_starts(tmp_path: Path, varied_model_dir: Path) -> None:
    done = subprocess.run(train_command(tmp_path, "train.steps=3", f"train.distill.model={varied_model_dir}",
                                        "train.distill.task_reward=false", "rollout.filter_equal_rewards=true",
                                        "warmstart.check_tasks=0"),  # the success checks: not asserted here
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "local"
    assert "distill teacher" in done.stdout and "0 teacher_unavailable" in done.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    # every trained token was scored by the teacher (it never failed here), and the KL term is live
    assert all(m["distill/scored_fraction"] == pytest.approx(1.0) for m in metrics), metrics[0]
    assert all(m["distill/reverse_kl"] != 0.0 for m in metrics)
    summary = json.loads((run / "summary.json").read_text())
    (worker,) = summary["rollout"]
    assert worker["distill"]["scored"] == worker["sent"] > 0 and worker["distill"].get("teacher_unavailable", 0) == 0
    # distilling keeps groups of equal rewards (the teacher's signal is per token)
    assert "equal_rewards" not in worker["groups_dropped"]
    assert "teacher" in summary["parts"]
    assert processes_mentioning(str(run / "config.yaml")) == []  # the teacher engine too is gone
