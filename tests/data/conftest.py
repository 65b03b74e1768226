"""One embedded engine process on the varied tiny model, shared by the data tests that need a server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime_async.launch.process import EngineProcess, start_engine


@pytest.fixture(scope="session")
def engine(varied_model_dir: Path) -> Iterator[EngineProcess]:
    proc = start_engine(varied_model_dir, "--max-batch-size", "16", "--context-length", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tokenizer(varied_model_dir: Path):
    return AutoTokenizer.from_pretrained(varied_model_dir)
