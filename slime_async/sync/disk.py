"""Disk mode: one safetensors file per version, written so that a reader never sees half of it, then
each engine told to load it (SGLang's `/update_weights_from_disk`, or vLLM's reload: `sync.vllm`)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from slime_async.sync.push import Engines, NamedWeights, Prepared
from slime_async.sync.vllm import vllm_push_disk, with_tied_head

WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def write_version(root: Path, version: int, named: Iterable[tuple[str, torch.Tensor]], *,
                  weights_file: str = WEIGHTS_FILE, extra: dict[str, str] | None = None) -> Path:
    """Write `root/v<version>/<weights_file>` (and the text files `extra`) atomically and return the
    directory.

    The files are written and fsynced in a temporary directory next to it, which is then renamed:
    an engine told to load `v<version>` finds either nothing or all of it.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version}"
    tmp = root / f".v{version}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
        path = tmp / weights_file
        save_file(tensors, str(path), metadata={"format": "pt", "weight_version": str(version)})
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        for f in tmp.iterdir():
            with open(f, "rb") as fd:
                os.fsync(fd.fileno())
        if final.exists():  # the same version written again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_versions(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest `v<N>` directories (and stale temporaries); returns what went."""
    versions = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir()
    ) if root.is_dir() else []
    removed = [p for _, p in versions[:-keep]] if keep > 0 else [p for _, p in versions]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


async def prepare_disk(pub: Engines, weights: NamedWeights, version: int, disk_dir: Path) -> Prepared:
    """Write `version`'s file once; returns the per-engine push (its kind's disk route), the bytes, 1."""
    def write() -> tuple[Path, int]:
        named = list(weights())
        if pub.kind.tied_head_by_name:
            named = with_tied_head(named)
        return write_version(disk_dir, version, named), sum(t.numel() * t.element_size() for _, t in named)

    path, nbytes = await asyncio.to_thread(write)

    async def push_disk(url: str) -> None:
        if pub.kind.dialect == "vllm":
            await vllm_push_disk(pub, url, path.resolve(), version)
            return
        await pub.pause(url)
        await pub.post(url, "/update_weights_from_disk", {
            "model_path": str(path.resolve()), "weight_version": str(version), "flush_cache": False})

    return push_disk, nbytes, 1
