"""Shared fixtures: one tiny model per test session, made in a temporary cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory of the session's own, so that tests never touch the user's."""
    path = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    """The tiny model, made once per session the way `model.path: tiny` makes it."""
    from slime_async.train.tiny_model import cached_model_dir

    return cached_model_dir("tiny", seed=0)
