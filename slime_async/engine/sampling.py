"""Sampling a batch of next tokens, and the logprob each one is reported with.

Logprob semantics follow SGLang's default sampler (`sglang/srt/layers/sampler.py`, no
`SGLANG_RETURN_ORIGINAL_LOGPROB`): the reported logprob of a sampled token is
`log_softmax(logits / temperature)[token]`, taken before top-k/top-p/min-p filtering; for
greedy requests (temperature 0) it is `log_softmax(logits)[token]`. A trainer recomputes the same
quantity by dividing its logits by the same temperature.
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and logprobs for rows of `logits` [B, V]; per-row parameters are 1-D tensors of B.

    temperature 0 is greedy; top_k <= 0 disables top-k; top_p 1 and min_p 0 disable theirs.
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        probs = logprobs.exp()
        vocab = probs.shape[-1]
        if bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any()) or bool((min_p > 0).any()):
            probs = _filter(probs, top_p, top_k, min_p)
        sampled = torch.multinomial(probs, 1, generator=generator)[:, 0]
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _filter(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude (renormalised by multinomial)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1]))
    drop = rank >= k[:, None]
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays)
    cumulative = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= cumulative > top_p[:, None]
    drop |= sorted_probs < (min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_probs)
