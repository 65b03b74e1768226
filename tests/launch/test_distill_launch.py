"""What the launcher does for `train.distill`: the live view's teacher line, and Ray's placement of the
teacher it starts (a Ray run with a teacher actor: `tests/launch/test_ray.py`)."""

from __future__ import annotations

from pathlib import Path

from slime_async.config import load_config
from slime_async.launch.placement import bundles, counts
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


def test_ray_mode_places_the_teacher_it_starts_and_none_it_attaches_to(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs/local.yaml", ["train.distill.model=tiny", f"run.dir={tmp_path}",
                                                    "launch.ray.teacher.gpus=0"])
    part = RayLauncher(cfg, tmp_path / "c.yaml", tmp_path)._part_config(cfg)
    assert part.train.distill.model is not None and Path(part.train.distill.model).is_absolute()  # any node's
    assert (Path(part.train.distill.model) / "config.json").is_file()
    assert counts(cfg)["teacher"] == 1 and bundles(cfg)["teacher"] == [{"CPU": 1.0}]
    attached = load_config(REPO / "configs/local.yaml", ["train.distill.model=tiny",
                                                         "train.distill.urls=[http://127.0.0.1:9]",
                                                         f"run.dir={tmp_path}"])
    assert counts(attached)["teacher"] == 0 and bundles(attached)["teacher"] == []
    assert counts(load_config(REPO / "configs/local.yaml"))["teacher"] == 0  # not distilling
