"""Per-token log-probabilities and entropies from logits split over the vocabulary (tensor parallelism).

Each tensor-parallel rank holds the logits of a contiguous slice of the (padded) vocabulary. The
log-softmax needs three reductions over ranks: the max (no gradient: it only keeps exp in range),
the sum of exponentials, and the target's logit (nonzero on one rank only). Sums go through
Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward), which
gives each rank the gradient of its own logits. Padded vocabulary rows are masked out, so the result
equals a log-softmax over the real vocabulary, as the engines' is. Computed in float32 whatever the
logits' dtype, like the torch backend and the engine's sampler.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [b, s] (and the entropy [b, s]) from this rank's logits [b, s, V / tp] of
    log_softmax(logits / temperature) over the first `vocab_size` entries of the whole vocabulary."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = ps.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    real = vocab_size - start  # entries of this slice that are real vocabulary
    if real < part:
        pad = torch.arange(part, device=x.device) >= real
        x = x.masked_fill(pad, float("-inf"))
    with torch.no_grad():
        m = x.max(dim=-1).values
        if tp > 1:
            group = ps.get_tensor_model_parallel_group()
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = x - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(mine, picked, torch.zeros_like(picked))  # where, not *: picked may be -inf
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        target = reduce_from_tensor_model_parallel_region(target)
    log_z = sum_exp.log()
    logp = target - log_z
    if not entropy:
        return logp, None
    # H = log Z - sum_i p_i * shifted_i, with p_i = exp_i / Z; padded entries have exp_i = 0
    weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)
    if tp > 1:
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    return logp, log_z - weighted / sum_exp
