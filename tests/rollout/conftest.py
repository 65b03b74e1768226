"""Two embedded engine processes on the varied tiny model, shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_async.launch.process import EngineProcess, start_engine


@pytest.fixture(scope="module")
def engines(varied_model_dir: Path) -> Iterator[list[EngineProcess]]:
    procs = [start_engine(varied_model_dir, "--max-batch-size", "16", "--context-length", "1024") for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()
