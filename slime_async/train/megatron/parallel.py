"""Process groups: `torch.distributed` and Megatron's model-parallel state, and this rank's place in them.

Megatron keeps its parallel state in module globals; `init_parallel` sets it once per process and
reuses it when asked again for the same sizes (several backends in one process, e.g. tests),
refusing other sizes. A process started without a distributed environment makes a world of one
on loopback (gloo on CPU, NCCL on GPU).

Experts (MoE) are never split by tensor parallelism (Megatron's expert tensor parallel size is 1):
with tensor parallelism each rank of a tensor-parallel group routes its own part of the sequence
(sequence parallelism) through whole experts. Expert parallelism splits each layer's experts over
`expert_parallel` ranks of the tensor x data-parallel ranks (Megatron's `expert_model_parallel_size`;
Megatron's expert grid takes a tensor-parallel group's ranks first): those ranks send each token to
the rank holding its expert. Expert weights are then reduced over the expert-data-parallel group
(tensor x data-parallel size / expert_parallel ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Parallel sizes, this rank's coordinates and its groups."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    rank: int
    device: torch.device
    tp_group: Any
    pp_group: Any
    dp_group: Any
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    """The ranks that hold the other experts of this rank's layers (None for dense models)."""
    expert_dp_group: Any = None
    """The ranks holding the same experts, among which expert gradients are summed."""
    expert_dp: int = 1
    """The size of `expert_dp_group`."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(tensor_parallel: int, pipeline_parallel: int, data_parallel: int | None, device: torch.device,
                  expert_parallel: int = 1) -> Layout:
    """Initialise (or reuse) the process groups for these sizes; ValueError naming the field when the
    world does not match them."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:  # a launcher's rank: its world, from the environment
            dist.init_process_group(backend)
        else:
            # a lone process: a world of one on an in-process store. No port (a free one picked then
            # bound later can be taken meanwhile), and nothing written to os.environ: a RANK or
            # MASTER_PORT left there reached every process this one started, which then joined
            # this one's world (EADDRINUSE on its port)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    model_parallel = tensor_parallel * pipeline_parallel
    if world % model_parallel:
        raise ValueError(f"train.megatron: world size {world} is not a multiple of tensor_parallel x "
                         f"pipeline_parallel = {model_parallel}")
    if data_parallel is not None and data_parallel * model_parallel != world:
        raise ValueError(f"train.megatron.data_parallel: {data_parallel} x tensor_parallel x pipeline_parallel = "
                         f"{data_parallel * model_parallel}, but the world size is {world}")
    dp = world // model_parallel
    if (dp * tensor_parallel) % expert_parallel:
        raise ValueError(f"train.megatron.expert_parallel: {expert_parallel} does not divide tensor_parallel x "
                         f"data-parallel size {tensor_parallel * dp} (experts are split over those ranks)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tensor_parallel, pipeline_parallel, expert_parallel):
            raise ValueError(f"train.megatron: this process already runs tensor/pipeline/expert parallel sizes "
                             f"{have}, cannot also run {(tensor_parallel, pipeline_parallel, expert_parallel)}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                     pipeline_model_parallel_size=pipeline_parallel,
                                     expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=1)
        if device.type == "cuda":
            # the per-rank RNG streams Megatron's layers expect to exist (nothing here draws from them:
            # no dropout, weights are loaded); the process's own CUDA RNG (run.seed) is left as it was
            state = torch.cuda.get_rng_state()
            mtp.model_parallel_cuda_manual_seed(1234)
            torch.cuda.set_rng_state(state)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return Layout(
        tp=tensor_parallel, pp=pipeline_parallel, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), rank=dist.get_rank(), device=device,
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        ep=expert_parallel, ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(), expert_dp_group=ps.get_expert_data_parallel_group(),
        expert_dp=ps.get_expert_data_parallel_world_size(),
    )
