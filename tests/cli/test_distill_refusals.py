"""`train.distill` refused before any part starts, through the real `slime-async` entry point: a teacher
whose tokenizer is not the student's, or no model at all, is one line naming the field, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import ConfigError
from slime_async.config.model_dir import check_teacher
from slime_async.models.tiny_model import PRESETS, make_model

CLI = Path(sys.executable).with_name("slime-async")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose BPE vocabulary was trained on another seed's corpus: other ids for some text."""
    return make_model(tmp_path_factory.mktemp("other") / "model", PRESETS["tiny"], seed=1)


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), "train", str(REPO / "configs/local.yaml"), f"run.dir={tmp_path}",
                           "warmstart.enabled=false", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path: Path, tiny_model_dir: Path,
                                                                  other_tokenizer_model: Path) -> None:
    result = train(tmp_path, f"train.distill.model={other_tokenizer_model}")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: train.distill.model: "), result.stderr
    assert "the teacher's tokenizer" in result.stderr and "is not the student's" in result.stderr
    assert not (tmp_path / "local").exists()  # no run was started


def test_a_missing_teacher_is_refused_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = train(tmp_path, f"train.distill.model={tmp_path / 'nowhere'}")
    assert result.returncode == 2 and result.stderr.startswith("error: train.distill.model: "), result.stderr
    assert "does not exist" in result.stderr and result.stderr.count("\n") == 1


def test_a_teacher_that_shares_the_tokenizer_passes(tiny_model_dir: Path, varied_model_dir: Path,
                                                    other_tokenizer_model: Path) -> None:
    assert check_teacher(tiny_model_dir, varied_model_dir) == varied_model_dir
    assert check_teacher(tiny_model_dir, "tiny") == tiny_model_dir  # a preset, as model.path and serve take it
    with pytest.raises(ConfigError, match="tokens differ"):
        check_teacher(tiny_model_dir, other_tokenizer_model)
