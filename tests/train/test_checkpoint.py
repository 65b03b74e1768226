"""Checkpoint files: atomic, pruned, RNG restored, extra state must be JSON."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from slime_async.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


class FakeBackend:
    """Only the files matter here (the real backend's save/load is tested in test_torch_backend)."""

    def __init__(self) -> None:
        self.loaded: Path | None = None

    def save(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights").write_text("w")

    def load(self, path: Path) -> None:
        self.loaded = path


def test_save_prune_latest_and_rng(tmp_path: Path) -> None:
    be = FakeBackend()
    for v in (1, 2, 3):
        save_checkpoint(tmp_path, v, be, {"counters": {"a": v}}, {"data": {"offset": 4 * v}}, keep=2)  # type: ignore[arg-type]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    save_checkpoint(tmp_path, 4, be, {}, {}, keep=3)  # type: ignore[arg-type]
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    state = load_checkpoint(tmp_path / "step_00000004", be)  # type: ignore[arg-type]
    assert state["version"] == 4 and be.loaded == tmp_path / "step_00000004" / "model"
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    assert load_checkpoint(latest, be)["extra"] == {"data": {"offset": 12}}  # type: ignore[arg-type]


def test_bad_extra_state_fails_and_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    be = FakeBackend()
    save_checkpoint(tmp_path, 1, be, {}, {}, keep=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 2, be, {}, {"buffer": {"obj": object()}}, keep=2)  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    with pytest.raises(ValueError, match=r"state\.json"):
        load_checkpoint(tmp_path / "nothing", be)  # type: ignore[arg-type]
