"""Per-token log-probabilities and entropies from logits split over the vocabulary (tensor parallelism).

Each tensor-parallel rank holds the logits of a contiguous slice of the (padded) vocabulary. Each
rank takes the log-sum-exp of its slice; the global one is m + log(sum_r exp(lse_r - m)) with m the
largest lse_r (no gradient: it only keeps exp in range); the target's logit is nonzero on one rank
only. Sums over ranks go through Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
forward, identity backward), which gives each rank the gradient of its own logits provided what
follows a sum is computed alike on every rank (hence the entropy's own sums). Padded vocabulary
entries are -inf, so the result is a log-softmax over the real vocabulary, as the engines' is.

Float32 whatever the logits' dtype (like the torch backend and the engine's sampler). Memory: one
float32 copy of the logits is kept for the backward pass (logsumexp's input); the entropy, when
asked for, adds the probabilities.
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
    log_softmax(logits / temperature) over the first `vocab_size` entries of the whole vocabulary.
    Every rank's slice must hold at least one real entry (`ModelShape` checks the padding)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    real = vocab_size - start  # entries of this slice that are real vocabulary
    pad = torch.arange(part, device=x.device) >= real if real < part else None
    if pad is not None:
        x = x.masked_fill(pad, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    with torch.no_grad():
        m = lse.detach().clone()  # >= every logit of every rank once reduced: exp(x - m) <= 1
        if tp > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                         group=ps.get_tensor_model_parallel_group())
    if tp > 1:
        lse = m + _sum_over_ranks((lse - m).exp()).log()
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = x.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(mine, picked, torch.zeros_like(picked))  # where, not *: picked may be -inf
    if tp > 1:
        target = _sum_over_ranks(target)
    logp = target - lse
    if not entropy:
        return logp, None
    # H = m + log Z - S / Z with Z = sum_i e_i, S = sum_i e_i x_i, e_i = exp(x_i - m). Only sums over
    # ranks feed what follows, so every rank's backward sees the same gradient of them (which the
    # identity backward of the all-reduce needs); padded entries have e_i = 0 and count as x_i = 0.
    e = (x - m.unsqueeze(-1)).exp()
    z = e.sum(dim=-1)
    weighted = (e * (x if pad is None else x.masked_fill(pad, 0.0))).sum(dim=-1)
    if tp > 1:
        z, weighted = _sum_over_ranks(z), _sum_over_ranks(weighted)
    return logp, m + z.log() - weighted / z

def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over tensor-parallel ranks: all-reduce forward, identity backward. On a copy: the all-reduce
    is in place, and `t` may be saved for its producer's backward (exp saves its output)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t.clone())
