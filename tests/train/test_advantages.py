"""Advantages against hand-computed values, including single-sample and equal-reward groups."""

from __future__ import annotations

import math

import pytest
import torch

from slime_async.train.advantages import (
    dr_grpo_advantages,
    group_mean,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reward_to_go,
    to_tokens,
)

T = torch.tensor


def test_grpo_with_std_matches_hand_computation() -> None:
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 1: 3, 1 -> mean 2, std sqrt(2)
    rewards = T([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    groups = T([0, 0, 0, 0, 1, 1])
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    want = T([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 1 / s1, -1 / s1])
    torch.testing.assert_close(grpo_advantages(rewards, groups, eps=0.0), want)


def test_dr_grpo_has_no_std() -> None:
    rewards = T([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    groups = T([0, 0, 0, 0, 1, 1])
    torch.testing.assert_close(dr_grpo_advantages(rewards, groups), T([0.5, -0.5, -0.5, 0.5, 1.0, -1.0]))
    torch.testing.assert_close(grpo_advantages(rewards, groups, normalize_std=False),
                               dr_grpo_advantages(rewards, groups))


def test_equal_rewards_and_single_sample_groups_give_exact_zeros() -> None:
    rewards = T([2.0, 2.0, 2.0, 5.0])  # group 0 all equal; group 1 one sample
    groups = T([0, 0, 0, 1])
    for adv in (grpo_advantages(rewards, groups), dr_grpo_advantages(rewards, groups)):
        assert torch.equal(adv, torch.zeros(4))
    mask = torch.ones(4, 3)
    assert torch.equal(reinforce_pp_baseline_advantages(rewards, groups, mask), torch.zeros(4, 3))


def test_groups_need_not_be_contiguous() -> None:
    rewards = T([1.0, 10.0, 3.0, 20.0])
    groups = T([0, 1, 0, 1])
    torch.testing.assert_close(group_mean(rewards, groups), T([2.0, 15.0, 2.0, 15.0]))


def test_reinforce_pp_subtracts_group_mean_then_whitens_over_tokens() -> None:
    rewards = T([1.0, 0.0, 4.0, 2.0])
    groups = T([0, 0, 1, 1])
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)  # last row all masked
    # centred: 0.5, -0.5, 1.0, -1.0 -> tokens: 0.5, 0.5, -0.5, 1, 1, 1 (6 tokens)
    vals = [0.5, 0.5, -0.5, 1.0, 1.0, 1.0]
    mean = sum(vals) / 6
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 6)
    w = [(v - mean) / std for v in vals]
    want = T([[w[0], w[1], 0], [w[2], 0, 0], [w[3], w[4], w[5]], [0, 0, 0]])
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards, groups, mask), want, atol=1e-5, rtol=1e-5)


def test_masked_whiten_of_nothing_is_zero() -> None:
    assert torch.equal(masked_whiten(torch.ones(2, 2), torch.zeros(2, 2)), torch.zeros(2, 2))


def test_reward_to_go_sums_to_the_end_over_trained_tokens() -> None:
    r = T([[1.0, 2.0, 3.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = T([[1, 1, 1, 0], [0, 1, 0, 1]], dtype=torch.float32)
    torch.testing.assert_close(reward_to_go(r, mask), T([[6.0, 5.0, 3.0, 0.0], [0.0, 10.0, 0.0, 5.0]]))


def test_to_tokens_broadcasts_and_masks() -> None:
    torch.testing.assert_close(to_tokens(T([2.0, -1.0]), T([[1, 0], [1, 1]])), T([[2.0, 0.0], [-1.0, -1.0]]))


def test_mismatched_shapes_are_rejected_with_names() -> None:
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(T([1.0, 2.0]), T([0]))
