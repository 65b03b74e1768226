"""Advantages from scalar rewards: pure functions of tensors.

Shapes: `rewards` [N] (one per trajectory), `group_index` [N] (dense ids 0..G-1: trajectories
sampled for the same task share one), per-token tensors [N, T] with a 0/1 `mask` of the tokens
that train. A group of one sample, or a group whose rewards are all equal, carries no signal:
its advantages are exactly 0 (never NaN).
"""

from __future__ import annotations

import torch


def _check(rewards: torch.Tensor, group_index: torch.Tensor) -> int:
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be 1-D of the same length"
        )
    if group_index.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index: ids must be >= 0")
    return int(group_index.max()) + 1 if group_index.numel() else 0


def group_mean(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Mean of `values` [N] over each one's group, returned per element [N]."""
    g = _check(values, group_index)
    sums = torch.zeros(g, dtype=values.dtype, device=values.device).index_add_(0, group_index, values)
    counts = torch.zeros(g, dtype=values.dtype, device=values.device)
    counts.index_add_(0, group_index, torch.ones_like(values))
    return (sums / counts.clamp(min=1))[group_index]


def group_std(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Unbiased (n - 1) standard deviation over each one's group, per element; 0 for groups of one."""
    g = _check(values, group_index)
    centred = values - group_mean(values, group_index)
    sq = torch.zeros(g, dtype=values.dtype, device=values.device).index_add_(0, group_index, centred**2)
    counts = torch.zeros(g, dtype=values.dtype, device=values.device)
    counts.index_add_(0, group_index, torch.ones_like(values))
    var = sq / (counts - 1).clamp(min=1)
    return var.sqrt()[group_index]


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - mean of the group) / (std of the group + eps), per trajectory [N].

    Without std normalisation this is Dr.GRPO's advantage (which removes the std's difficulty bias).
    """
    adv = rewards - group_mean(rewards, group_index)
    if normalize_std:
        adv = adv / (group_std(rewards, group_index) + eps)
    return adv


def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): r - mean of the group, no std division."""
    return grpo_advantages(rewards, group_index, normalize_std=False)


def to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per sequence [N] to its trained tokens [N, T] (0 where masked)."""
    return seq_values[:, None].to(torch.float32) * mask.to(torch.float32)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / std over the masked entries (population std); 0 where masked or nothing varies."""
    m = mask.to(values.dtype)
    n = m.sum()
    if n == 0:
        return torch.zeros_like(values)
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / n
    return (values - mean) * torch.rsqrt(var + eps) * m


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): subtract the group's mean reward, then whiten over all
    trained tokens of the batch. Per token [N, T].

    `token_rewards` [N, T] (e.g. a KL penalty's reward-to-go) is added before whitening.
    """
    adv = to_tokens(rewards - group_mean(rewards, group_index), mask)
    if token_rewards is not None:
        adv = adv + token_rewards * mask
    return masked_whiten(adv, mask)


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the trained tokens from t to the end (gamma = 1), per token [N, T]; 0 where masked.

    This is how a per-token penalty in the reward (KL in reward) reaches each token's return.
    """
    r = token_rewards * mask
    return torch.flip(torch.cumsum(torch.flip(r, dims=[1]), dim=1), dims=[1]) * mask
