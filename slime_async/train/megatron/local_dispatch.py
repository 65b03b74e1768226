"""MoE token dispatch without expert parallelism as one sort on the device (`train.megatron.moe_local_dispatch`).

With `expert_parallel: 1` every rank holds every expert whole (experts are never split by tensor
parallelism here), so a token never leaves its rank: dispatch is only a permutation of the rows into
expert order, and combine its inverse plus the sum over each token's k experts. Megatron's all-to-all
dispatcher does that permutation too, but on the way it makes the host wait for the GPU in every MoE
layer, forward and backward: its `permute` selects rows with `masked_select` (the output size is known
only on the host) and it hands the tokens per expert over as a host array (`before_finish` sync
point), which grouped kernels that take a host list need and ours do not. Profiled on an H100 (4
Qwen3-30B-A3B layers): the GPU stood idle 215 ms of a 528 ms step. With this dispatcher (16 x 4096
tokens a step, `bench megatron_moe_gpu`): 75 ms idle of 1,048, and 1.22x the tokens/s of Megatron's.

`LocalSortDispatcher` speaks the dispatcher interface that `MoELayer` calls (megatron-core 0.16 and
0.19 alike: `dispatch_preprocess`, `token_dispatch`, `dispatch_postprocess`, `combine_preprocess`,
`token_combine`, `combine_postprocess`) and computes, with fixed-size tensors only:

- each token's k experts: the top-k of its routing map (exactly k per row: dropless routing);
- `order`: the stable argsort of the [tokens x k] expert ids, so rows come grouped by expert, and
  within an expert in token order (as Megatron's permutation and the engine's grouped step);
- tokens per expert: the ids counted on the device (`moe.experts.sort_by_expert`, with `order`;
  `GroupedExperts` takes group ends from there);
- rows = each token's k copies taken in `order` (`take_rows`: a gather forward; backward puts each
  row's gradient back in [token, k] order, a permutation with no atomic adds, and sums the k copies
  per token in a fixed order);
- the experts' outputs, already weighted by their routing weights, put back in [token, k] order by
  `order` and summed over k.

Nothing waits for the GPU, and the result is the all-to-all dispatcher's up to the summation order
(tests/megatron/test_moe_parity.py checks forward, replay, router losses and every gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from slime_async.moe.experts import sort_by_expert


def sum_back(rows: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: rows [T*k, H] in `order` (a permutation of range(T*k)) put back in [token, k] order and
    summed over each token's k. `order` being a permutation, each row lands in its own place: a copy,
    not an (atomic) add. Combine's forward and `take_rows`' backward."""
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)
    return unsorted.view(-1, k, rows.shape[-1]).sum(dim=1)


class _TakeRows(torch.autograd.Function):
    """rows [T*k, H] = x[order // k] for x [T, H] and `order` a permutation of range(T*k)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        return sum_back(grad, order, ctx.k), None, None


def take_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Each token of x [T, H] k times, the T*k copies taken in `order` (a permutation of range(T*k), copy
    j of token t at t*k + j): `x.repeat_interleave(k, 0)[order]`. The obvious autograd of that (an
    `index_select` of the repeated rows) backs into a scatter-add with atomics over T*k rows, in bf16:
    37 ms of a 1,048 ms step on an H100 (`bench megatron_moe_gpu`'s profile); this backward is a
    permutation and a sum over k."""
    return _TakeRows.apply(x, order, k)


class LocalSortDispatcher:
    """Dispatch to experts that are all on this rank: a device-side sort, no host synchronisation."""

    def __init__(self, num_experts: int, topk: int) -> None:
        self.num_experts = num_experts
        self.topk = topk
        self._shape: torch.Size | None = None
        self._order: torch.Tensor | None = None
        self._tokens_per_expert: torch.Tensor | None = None

    def dispatch_preprocess(self, hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [.., H], routing map [T, E] bool, probs [T, E]) -> (rows [T*k, H] by expert, their weights)."""
        self._shape = hidden.shape
        hidden = hidden.reshape(-1, hidden.shape[-1])
        k = self.topk
        # a bool has no top-k; any number type ranks the k set entries first
        ids = torch.topk(routing_map.to(torch.int32), k, dim=1, sorted=False).indices
        # counted from the same ids as `order` (not the map's column sums), so the experts' groups cover
        # every row even for a map that is not k-hot (such a row then carries a zero routing weight)
        order, self._tokens_per_expert = sort_by_expert(ids.reshape(-1), self.num_experts)
        self._order = order
        weights = probs.gather(1, ids).reshape(-1)
        return take_rows(hidden, order, k), weights.index_select(0, order)

    def token_dispatch(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, probs  # no rank to send to

    def dispatch_postprocess(self, hidden: torch.Tensor, probs: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self._tokens_per_expert is not None, "dispatch_postprocess before dispatch_preprocess"
        return hidden, self._tokens_per_expert, probs

    def get_expert_zero_copy_buffers(self) -> tuple[None, None]:
        return None, None  # megatron-core 0.19 asks; the experts allocate their own output

    def combine_preprocess(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def token_combine(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def combine_postprocess(self, output: torch.Tensor) -> torch.Tensor:
        """Expert outputs [T*k, H] in expert order (already weighted) -> [.., H]: each token's k summed."""
        assert self._order is not None and self._shape is not None, "combine before dispatch"
        return sum_back(output, self._order, self.topk).view(self._shape)


def use_local_dispatch(model: torch.nn.Module) -> int:
    """Give every MoE layer of `model` a `LocalSortDispatcher`; returns how many. Only for models
    built with one expert-parallel rank (every expert local)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    count = 0
    for m in model.modules():
        if isinstance(m, MoELayer):
            config: Any = m.config
            if config.expert_model_parallel_size != 1 or (config.expert_tensor_parallel_size or 1) != 1:
                raise ValueError("train.megatron.moe_local_dispatch needs every expert whole on every rank "
                                 "(expert_parallel: 1)")
            m.token_dispatcher = LocalSortDispatcher(config.num_moe_experts, config.moe_router_topk)
            count += 1
    return count
