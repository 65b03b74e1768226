"""Policy losses, off-policy corrections, penalties, aggregation and metrics: pure functions of tensors.

Every per-token tensor is [N, T], aligned so that entry t belongs to token t of the sequence.
`mask` is 0/1 (1 = the token trains). Three logprobs exist per token (docs/architecture.md, "Losses
and off-policy correction"): `behav` (the engine's, at sampling time), `prox` (the proximal policy:
recomputed by the trainer before the step, no gradient) and `logp` (current, with gradient).

Losses return per-token values; `aggregation_weights` turns a mask into per-token weights over the
whole batch, so that `(values * weights).sum()` is the batch loss and micro-batches simply add up.
Masked entries never contribute, and never produce NaN, whatever their logprobs hold.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "group_mean"]
Level = Literal["none", "token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]


class PolicyLoss(NamedTuple):
    """Per-token loss [N, T] (0 where masked), which tokens the clip was active on, and the ratio used."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def _log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a - b where mask, 0 elsewhere (so padding's garbage never reaches exp)."""
    return torch.where(mask.bool(), a - b, torch.zeros_like(a))


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO's pessimistic surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token.

    clip_high > clip_low is DAPO's clip-higher. With `dual_clip` c > 1 (Ye et al. 2020), a token with
    A < 0 loses at most -c A, so a huge ratio on a bad token cannot dominate the batch.
    """
    m = mask.bool()
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    active = clipped_loss > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip: must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
        active = active | dual_active
    return PolicyLoss(torch.where(m, loss, torch.zeros_like(loss)), active & m, ratio)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO-clip (and GRPO's token loss) with ratio exp(logp - old_logp) per token.

    Decoupled PPO is this with `old_logp` = the proximal policy, multiplied by `behaviour_weights`.
    """
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    return clipped_surrogate(ratio, adv, mask, clip_low, clip_high, dual_clip)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised log-ratio of each sequence, mean over its trained tokens [N] (0 if none)."""
    lens = mask.sum(dim=1)
    return _log_ratio(logp, old_logp, mask).sum(dim=1) / lens.clamp(min=1)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025): one ratio per sequence, exp(mean log-ratio), clipped as in PPO.

    Written in GSPO-token form: each token's ratio has the sequence ratio's value and gradient
    s * grad(logp_t), so that with `seq_mean_token_mean` aggregation the gradient is exactly GSPO's.
    """
    s = sequence_log_ratio(logp, old_logp, mask).detach()
    token_term = _log_ratio(logp, logp.detach(), mask)  # 0 in value, grad(logp) in gradient
    ratio = torch.exp(s[:, None] + token_term)
    return clipped_surrogate(ratio, adv, mask, clip_low, clip_high)


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 5.0,
) -> PolicyLoss:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp per token.

    The importance weight is clipped and detached, but every token keeps its gradient (PPO's clip
    zeroes the gradient of clipped tokens instead). clip_low = 1 leaves no lower bound.
    """
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    m = mask.bool()
    loss = torch.where(m, -weight * adv * logp, torch.zeros_like(logp))
    active = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)) & m
    return PolicyLoss(loss, active, ratio)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLoss:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): -f(r) A per token, f(r) = (4 / tau) sigmoid(tau (r - 1)),
    tau = tau_pos where A > 0 and tau_neg elsewhere: a smooth gate on the ratio instead of PPO's clip.

    Its gradient is w A r grad(logp) with w = 4 s (1 - s), s = sigmoid(tau (r - 1)), i.e. sech^2(tau (r - 1) / 2):
    w = 1 at r = 1 (there it is exactly the plain policy gradient A grad(logp), whatever tau), and it
    fades smoothly as the ratio leaves 1 (to half at |r - 1| = 1.76 / tau), never to zero. PPO's clip
    instead keeps the whole gradient inside its band and none outside. The larger tau_neg fades the
    negative tokens' gradient sooner: a negative advantage raises the logits of every token not
    sampled, a push that spreads over the vocabulary. `clipped` marks the tokens whose gradient the
    gate at least halved (w < 1/2), the soft counterpart of PPO's clip fraction.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    m = mask.bool()
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    x = tau * (ratio - 1.0)
    loss = -(4.0 / tau) * torch.sigmoid(x) * adv
    with torch.no_grad():
        weight = 4.0 * torch.sigmoid(x) * torch.sigmoid(-x)
    return PolicyLoss(torch.where(m, loss, torch.zeros_like(loss)), (weight < 0.5) & m, ratio)


def behaviour_weights(
    prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, level: Level = "token", cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights proximal/behaviour [N, T], no gradient, 0 where masked.

    `token`: min(exp(prox_t - behav_t), cap) per token (decoupled PPO's weight; token-level TIS).
    `sequence`: min(exp(sum over the sequence of prox - behav), cap), the same for all its tokens.
    `none`: 1.
    """
    if cap <= 0:
        raise ValueError(f"behaviour cap must be > 0, got {cap}")
    m = mask.to(torch.float32)
    lr = _log_ratio(prox, behav, mask).detach()
    log_cap = math.log(cap)
    if level == "none":
        w = torch.ones_like(lr)
    elif level == "token":
        w = torch.exp(lr.clamp(max=log_cap))
    elif level == "sequence":
        w = torch.exp(lr.sum(dim=1).clamp(max=log_cap))[:, None].expand_as(lr)
    else:
        raise ValueError(f"behaviour correction level: expected none, token or sequence, got {level!r}")
    return w * m


def outlier_mask(
    prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, level: Level = "token",
    low: float = 0.5, high: float = 2.0,
) -> torch.Tensor:
    """The mask without tokens whose proximal/behaviour ratio is outside [low, high] (float 0/1).

    `sequence` drops the whole sequence when any of its tokens is outside; `none` returns the mask.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"outlier bounds: need 0 < low <= 1 <= high, got low={low}, high={high}")
    m = mask.to(torch.float32)
    if level == "none":
        return m
    lr = _log_ratio(prox, behav, mask)
    bad = ((lr < math.log(low)) | (lr > math.log(high))) & mask.bool()
    if level == "token":
        return m * (~bad).to(m.dtype)
    if level == "sequence":
        return m * (~bad.any(dim=1, keepdim=True)).to(m.dtype)
    raise ValueError(f"outlier mask level: expected none, token or sequence, got {level!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: KLEstimator = "k3"
               ) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy (Schulman 2020).

    With x = logp - ref_logp: k1 = x (unbiased, high variance, can be negative); k2 = x^2 / 2;
    k3 = exp(-x) - 1 + x (unbiased, always >= 0). 0 where masked.
    """
    x = _log_ratio(logp, ref_logp, mask)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x**2
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"KL estimator: expected k1, k2 or k3, got {estimator!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def aggregation_weights(
    mask: torch.Tensor,
    mode: Aggregation,
    group_index: torch.Tensor | None = None,
    norm: float | None = None,
) -> torch.Tensor:
    """Per-token weights [N, T] over the whole batch such that `(values * weights).sum()` is the loss.

    - `token_mean`: every trained token of the batch weighs the same (DAPO).
    - `seq_mean_token_mean`: mean over each sequence's tokens, then over sequences (GRPO's original).
    - `seq_mean_token_sum_norm`: each sequence's token sum divided by the constant `norm`, then the
      mean over sequences (Dr.GRPO: no length bias).
    - `group_mean`: token mean within each group, then mean over groups (needs `group_index`).
    Sequences (groups) with no trained token are not counted; an all-masked batch weighs 0.
    """
    m = mask.to(torch.float32)
    lens = m.sum(dim=1)
    if mode == "token_mean":
        return m / m.sum().clamp(min=1)
    n_seq = (lens > 0).sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        return m / lens.clamp(min=1)[:, None] / n_seq
    if mode == "seq_mean_token_sum_norm":
        if norm is None or norm <= 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a positive norm (the max length), got {norm}")
        return m / norm / n_seq
    if mode == "group_mean":
        if group_index is None or group_index.shape != lens.shape:
            raise ValueError("group_mean aggregation needs group_index with one entry per sequence")
        g = int(group_index.max()) + 1 if group_index.numel() else 0
        group_tokens = torch.zeros(g, dtype=lens.dtype, device=lens.device).index_add_(0, group_index, lens)
        n_groups = (group_tokens > 0).sum().clamp(min=1)
        return m / group_tokens.clamp(min=1)[group_index][:, None] / n_groups
    raise ValueError(f"aggregation: expected one of token_mean, seq_mean_token_mean, "
                     f"seq_mean_token_sum_norm, group_mean; got {mode!r}")


def aggregate(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The scalar loss: sum of values * weights (weights from `aggregation_weights`)."""
    return (torch.where(weights != 0, values, torch.zeros_like(values)) * weights).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over entries where mask is 1; 0 when nothing is masked in."""
    m = mask.to(values.dtype)
    return (torch.where(mask.bool(), values, torch.zeros_like(values)) * m).sum() / m.sum().clamp(min=1)


@torch.no_grad()
def off_policy_metrics(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor | None = None,
) -> dict[str, float]:
    """What tells whether the off-policy correction is healthy, over the trained tokens.

    - `clip_fraction`: share of tokens where the clip was active.
    - `ratio_mean/min/max/std`: current/proximal ratio (exactly 1 on the first step from fresh logprobs).
    - `behav_prox_kl_k1`, `behav_prox_kl_k3`: KL(behaviour || proximal) estimated on the behaviour's samples.
    - `max_abs_dp`: largest |p_prox - p_behav| of a token's probability.
    - `ess`: normalised effective sample size of the weights prox/behav, (sum w)^2 / (n sum w^2), in (0, 1].
    - `behav_prox_abs_dlogp`: mean |log p_prox - log p_behav| (the trainer's and the engine's logprob of
      the same token; MoE routing replay exists to shrink it).
    - `behav_ratio_out`: share of tokens whose prox/behav leaves [0.8, 1.2] (what PPO's usual clip
      would clip if the engine's logprobs were the anchor).
    - `tokens`: trained tokens counted.
    """
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return {"tokens": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
                "ratio_std": 0.0, "behav_prox_kl_k1": 0.0, "behav_prox_kl_k3": 0.0, "max_abs_dp": 0.0, "ess": 1.0,
                "behav_prox_abs_dlogp": 0.0, "behav_ratio_out": 0.0}
    ratio = torch.exp(logp.detach()[m] - prox[m]).double()
    lr = (prox[m] - behav[m]).double()  # log(prox / behav)
    w = torch.exp(lr)
    return {
        "tokens": float(n),
        "clip_fraction": float(clipped[m].double().mean()) if clipped is not None else 0.0,
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ratio_std": float(ratio.std(unbiased=False)),
        "behav_prox_kl_k1": float((-lr).mean()),
        "behav_prox_kl_k3": float((w - 1 - lr).mean()),
        "max_abs_dp": float((torch.exp(prox[m].double()) - torch.exp(behav[m].double())).abs().max()),
        "ess": float(w.sum() ** 2 / (n * (w**2).sum())),
        "behav_prox_abs_dlogp": float(lr.abs().mean()),
        "behav_ratio_out": float(((w < 0.8) | (w > 1.2)).double().mean()),
    }
