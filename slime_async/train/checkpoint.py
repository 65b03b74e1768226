"""Checkpoints: model, optimizer, version, RNG, and the opaque state of other parts.

Layout of one checkpoint, `<root>/step_<version, 8 digits>/`:
- `model/`: the backend's own files (for `torch`: a HF model directory, loadable by an engine's
  `/update_weights_from_disk`, and `optimizer.pt`);
- `state.json`: the version, the trainer's counters and `extra` (one JSON-able dict per named
  part: the data source's offset, the buffer's WAL position, ...), written by their owners;
- `rng.pt`: torch (CPU and CUDA), numpy and Python RNG states (`rng_rank<R>.pt` for rank R > 0).
A checkpoint is written in a temporary directory and renamed whole: a crash mid-save leaves the
previous checkpoint as the latest. With several trainer ranks every rank calls `save_checkpoint`
(the backend's save is collective) into the same temporary directory on a filesystem they share;
rank 0 alone writes `state.json`, renames it and prunes, between barriers.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_async.train.backend import TrainerBackend

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    version: int,
    backend: TrainerBackend,
    trainer_state: dict[str, Any],
    extra: dict[str, dict[str, Any]],
    keep: int = 2,
    *,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Write `root/step_<version>` atomically; keep the `keep` newest. Returns its path. With several
    ranks, each calls this with its `rank` and a `barrier` over all of them."""
    final = root / f"step_{version:08d}"
    if barrier is None:
        tmp = root / f".step_{version:08d}.{uuid.uuid4().hex[:8]}.tmp"
    else:  # one name every rank knows; a leftover of a crashed save is cleared first
        tmp = root / f".step_{version:08d}.ranks.tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
    root.mkdir(parents=True, exist_ok=True)
    try:
        backend.save(tmp / "model")
        torch.save(rng_state(), tmp / _rng_file(rank))
        if barrier is not None:
            barrier()  # every rank's files are in before rank 0 renames the directory
        if rank == 0:
            try:
                text = json.dumps({"version": version, "trainer": trainer_state, "extra": extra}, indent=1)
            except TypeError as exc:
                raise ValueError(f"checkpoint extra state must be JSON-serialisable: {exc}") from None
            (tmp / "state.json").write_text(text)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if barrier is not None:
        barrier()  # the checkpoint is complete for everyone who looks next
    return final


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: Path, backend: TrainerBackend, rank: int = 0) -> dict[str, Any]:
    """Restore the backend and the RNGs (this `rank`'s own when saved, else rank 0's) from `path`;
    returns the `state.json` dict (`version`, `trainer`, `extra`)."""
    state_file = path / "state.json"
    if not state_file.is_file():
        raise ValueError(f"checkpoint {path}: no state.json (not a complete checkpoint)")
    state = json.loads(state_file.read_text())
    backend.load(path / "model")
    rng = path / _rng_file(rank)
    set_rng_state(torch.load(rng if rng.is_file() else path / "rng.pt", weights_only=True))
    return state
