"""Custom functions named by `train.advantage_fn` / `train.policy_loss_fn` in tests/train/test_objective.py."""

from __future__ import annotations

import torch


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward minus 0.5, one value per sequence."""
    return rewards - 0.5


def bad_shape(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return rewards[:1]


def reinforce(logp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float,
              clip_high: float) -> torch.Tensor:
    """Plain REINFORCE: -advantage x logprob per token."""
    return -adv * logp
