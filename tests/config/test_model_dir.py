"""`model.path` checks: each unusable directory gets an error naming the field and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slime_async.config import ConfigError
from slime_async.config.model_dir import check_model_dir, resolve_model_path


def test_tiny_resolves_to_the_cached_model(tiny_model_dir: Path) -> None:
    assert resolve_model_path("tiny") == tiny_model_dir
    assert check_model_dir(tiny_model_dir) == tiny_model_dir


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path: .*nope does not exist; make a tiny model there with "
                       r"`slime-async init-model .*nope`"):
        resolve_model_path(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config.json, so it is not a Hugging Face model directory"):
        check_model_dir(tmp_path, field="--model")


def test_tokenizer_without_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match=r"model.path: the tokenizer in .* has no chat template"):
        check_model_dir(broken)


def test_unreadable_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.path: cannot load a tokenizer from"):
        check_model_dir(broken)
