"""torch.distributed for the trainer's ranks: joining the group the launcher set up, and leaving it."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInit:
    """This process's place in the trainer's group, as the launcher hands it out."""

    rank: int
    world_size: int
    init_method: str
    """`tcp://HOST:PORT` of rank 0's rendezvous (the Ray launcher picks a free port on rank 0's node)."""


def init_distributed(dist: DistInit, timeout_s: float = 600.0) -> str:
    """Join the default process group (NCCL on GPUs, gloo on CPU); returns the backend used."""
    import torch.distributed as td

    if not 0 <= dist.rank < dist.world_size:
        raise ValueError(f"--rank {dist.rank} is outside the world of {dist.world_size}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # each rank's process sees only its own GPU (CUDA_VISIBLE_DEVICES)
    td.init_process_group(backend, init_method=dist.init_method, rank=dist.rank, world_size=dist.world_size,
                          timeout=datetime.timedelta(seconds=timeout_s))
    log.info("rank %d of %d joined %s (%s)", dist.rank, dist.world_size, dist.init_method, backend)
    return backend


def close_distributed() -> None:
    import torch.distributed as td

    if td.is_initialized():
        td.destroy_process_group()
