"""What the launcher does for `train.distill`: the live view's teacher line, and Ray's refusal to start
a teacher it has no placement for."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_async.config import ConfigError, load_config
from slime_async.launch.ray_launcher import RayLauncher
from slime_async.launch.train_run import distill_line

REPO = Path(__file__).resolve().parents[2]


def test_the_live_view_states_what_the_teacher_scored_and_missed() -> None:
    assert distill_line([{"sent": 3}]) is None  # not distilling: no line
    workers = [{"distill": {"scored": 40, "retries": 1}},
               {"distill": {"scored": 8, "teacher_unavailable": 4, "retries": 6}}]
    line = distill_line(workers)
    assert line == ("[yellow]48 trajectories scored, 4 teacher_unavailable (trained without the KL term), "
                    "7 retries[/]")
    assert distill_line(workers[:1]) == ("40 trajectories scored, 0 teacher_unavailable (trained without the "
                                         "KL term), 1 retries")


def test_ray_mode_asks_for_the_teachers_urls(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = load_config(REPO / "configs/local.yaml", [f"train.distill.model={tiny_model_dir}", f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^train\.distill\.urls: under --ray"):
        RayLauncher(cfg, tmp_path / "c.yaml", tmp_path)._part_config(cfg)
    attached = load_config(REPO / "configs/local.yaml", [f"train.distill.model={tiny_model_dir}",
                                                         "train.distill.urls=[http://127.0.0.1:9]",
                                                         f"run.dir={tmp_path}"])
    assert RayLauncher(attached, tmp_path / "c.yaml", tmp_path)._part_config(attached).train.distill.urls
