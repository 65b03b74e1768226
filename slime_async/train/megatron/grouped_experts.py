"""The Megatron backend's experts as grouped matrix products (`train.megatron.moe_grouped_gemm`, on by default).

Megatron's `SequentialMLP` runs one `MLP` per local expert from a Python loop: 128 experts x (two
matmuls, SwiGLU, the routing-weight product) forward, again in recomputation and twice in backward,
each a handful of kernels over a few hundred rows; on an H100 the GPU waited on the host most of a
step (3.3% MFU). Its grouped-GEMM alternatives need Transformer Engine (`TEGroupedMLP`) or the
`grouped_gemm` package (the legacy `GroupedMLP`), neither installed here nor on the GPU machine.

`GroupedExperts` takes the same place in Megatron's `MoELayer` (the token dispatcher's permuted rows,
the tokens per local expert, the permuted routing weights) and computes what `SequentialMLP` computes,
with every local expert's fc1 and fc2 stacked into one parameter each and `moe.experts.swiglu_experts`
(`torch._grouped_mm`, one launch per projection whatever the number of experts):

- `weight1` [local experts, 2 x expert intermediate, hidden]: expert i's fc1 = [gate; up] (the dense
  fc1's layout; HF's `gate_up_proj` of that expert);
- `weight2` [local experts, hidden, expert intermediate]: its fc2 (HF's `down_proj`).

`weights.global_names` shows each expert's slice under `SequentialMLP`'s name
(`mlp.experts.local_experts.<global expert>.linear_fc1/2.weight`), so loading, export, checkpoints
and expert parallelism keep the per-expert HF mapping of `sync.megatron_names`. The group ends go to
the device once per layer (the dispatcher hands over the counts on the host, after its own sync);
nothing else waits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from slime_async.moe.experts import swiglu_experts


class GroupedExperts(MegatronModule):
    """A `SequentialMLP` stand-in: the same experts' SwiGLU MLPs, as two grouped matmuls over stacked weights."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, pg_collection: Any = None,
                 name: str | None = None, **unused: Any) -> None:
        super().__init__(config=config)
        if not (config.gated_linear_unit and config.activation_func is F.silu) or config.add_bias_linear:
            raise ValueError("train.megatron.moe_grouped_gemm: grouped experts compute SwiGLU experts without "
                             "biases (Qwen3-MoE's)")
        self.num_local_experts = num_local_experts
        inter, hidden = config.moe_ffn_hidden_size, config.hidden_size
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * inter, hidden, **kw))  # type: ignore[arg-type]
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, inter, **kw))  # type: ignore[arg-type]
        # Megatron's DDP and optimizer reduce a parameter flagged `allreduce = False` over the expert
        # data-parallel ranks (tensor x data-parallel ranks / expert parallel: every rank holding the same
        # experts); its linear layers flag an expert's weights so under the same condition as here
        expert_groups = (config.expert_model_parallel_size > 1
                         or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        for w in (self.weight1, self.weight2):
            w.allreduce = not expert_groups  # type: ignore[attr-defined]

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                **unused: Any) -> tuple[torch.Tensor, None]:
        """(rows [N, hidden] through their experts, no bias) for rows sorted by local expert."""
        offs = tokens_per_expert.to(rows.device, non_blocking=True).cumsum(0, dtype=torch.int32)
        return swiglu_experts(rows, offs, self.weight1, self.weight2, F.silu, scale=probs), None

    def backward_dw(self) -> None:
        """Nothing is deferred: weight gradients come with the backward pass (Megatron asks only
        under `delay_wgrad_compute`, which this backend leaves off)."""
