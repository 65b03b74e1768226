"""The configured objective: recipes, overrides, and what `prepare` feeds the loss."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from slime_async.config.schema import TrainConfig
from slime_async.train.backend import Logprobs
from slime_async.train.batch import Batch
from slime_async.train.objective import Objective

T = torch.tensor


def batch() -> Batch:
    mask = T([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    return Batch(
        input_ids=torch.ones(3, 4, dtype=torch.int64), attention_mask=torch.ones(3, 4, dtype=torch.int64),
        loss_mask=mask, behaviour_logprobs=T([[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, -1.0, 0.0], [0.0, -1.0, 0, 0]]),
        rewards=T([1.0, 0.0, 5.0]), group_index=T([0, 0, 1]), min_versions=T([0, 0, 0]),
    )


def test_recipes_and_overrides() -> None:
    o = Objective(TrainConfig(loss="dr_grpo", max_seq_len=128))
    assert (o.policy, o.advantage, o.aggregation, o.norm) == ("ppo", "dr_grpo", "seq_mean_token_sum_norm", 128.0)
    g = Objective(TrainConfig(loss="gspo"))
    assert (g.policy, g.clip_low, g.clip_high) == ("gspo", 3e-4, 4e-4)
    c = Objective(TrainConfig(loss="cispo", clip_high=2.0, aggregation="group_mean", advantage="reinforce_pp"))
    assert (c.policy, c.clip_low, c.clip_high, c.aggregation, c.advantage) == ("cispo", 1.0, 2.0, "group_mean",
                                                                              "reinforce_pp")
    assert Objective(TrainConfig(loss="ppo")).correction == "none"
    assert Objective(TrainConfig(loss="decoupled_ppo", behaviour_correction="sequence")).correction == "sequence"


def test_prepare_decoupled_ppo_weights_and_advantages() -> None:
    b = batch()
    prox = b.behaviour_logprobs + T([[0.0, math.log(3.0), 0.0, math.log(0.5)], [0.0] * 4, [0.0] * 4])
    p = Objective(TrainConfig(loss="decoupled_ppo", behaviour_cap=2.0)).prepare(b, prox)
    torch.testing.assert_close(p.behaviour_weights, T([[0.0, 2.0, 1.0, 0.5], [0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0, 0]]))
    # group 0: rewards 1, 0 -> +-0.5 / sqrt(0.5) (unbiased std of two values); group 1: one sample -> 0
    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(p.advantages, T([[0.0, a, a, a], [0.0, -a, -a, 0.0], [0.0] * 4]), atol=1e-5, rtol=0)
    torch.testing.assert_close(p.weights.sum(), T(1.0))  # token_mean over 6 tokens
    assert Objective(TrainConfig(loss="ppo")).prepare(b, prox).behaviour_weights.equal(b.loss_mask)


def test_outlier_masking_removes_tokens_from_everything() -> None:
    b = batch()
    prox = b.behaviour_logprobs + T([[0.0, math.log(3.0), 0.0, 0.0], [0.0] * 4, [0.0] * 4])
    p = Objective(TrainConfig(outlier_mask="token")).prepare(b, prox)
    assert p.mask[0].tolist() == [0, 0, 1, 1]
    assert p.weights[0, 1] == 0 and p.advantages[0, 1] == 0
    s = Objective(TrainConfig(outlier_mask="sequence")).prepare(b, prox)
    assert s.mask[0].sum() == 0 and s.mask[1].sum() == 2


def test_kl_in_reward_enters_the_advantages() -> None:
    b = batch()
    prox = b.behaviour_logprobs.clone()
    ref = prox - T([[0.0, 0.5, 0.5, 0.5], [0.0] * 4, [0.0] * 4])  # policy above reference on row 0
    base = Objective(TrainConfig(loss="grpo", advantage="grpo_no_std")).prepare(b, prox).advantages
    o = Objective(TrainConfig(loss="grpo", advantage="grpo_no_std", kl_coef=0.1, kl_in="reward", kl_estimator="k1"))
    adv = o.prepare(b, prox, ref).advantages
    # k1 = 0.5 per token; reward-to-go of -0.05 per token over 3, 2, 1 remaining tokens
    torch.testing.assert_close(adv - base, T([[0.0, -0.15, -0.10, -0.05], [0.0] * 4, [0.0] * 4]))


def test_prepare_without_proximal_leaves_it_to_the_loss() -> None:
    b = batch()
    o = Objective(TrainConfig(loss="decoupled_ppo", behaviour_cap=2.0))
    assert o.can_fuse_proximal
    p = o.prepare(b, None)
    assert p.fused and p.prox.abs().sum() == 0
    # the loss fills proximal logprobs and behaviour weights from the forward it is given
    logp = b.behaviour_logprobs + T([[0.0, math.log(3.0), 0.0, math.log(0.5)], [0.0] * 4, [0.0] * 4])
    o.loss_fn(p)(b, slice(0, 3), Logprobs(logp.clone().requires_grad_(), None))
    p.settle()  # the loss leaves its results on the device until then (no host sync per micro-batch)
    torch.testing.assert_close(p.prox, logp)
    torch.testing.assert_close(p.behaviour_weights, T([[0.0, 2.0, 1.0, 0.5], [0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0, 0]]))
    for cfg in (TrainConfig(outlier_mask="token"), TrainConfig(kl_coef=0.1, kl_in="reward")):
        assert not Objective(cfg).can_fuse_proximal
        with pytest.raises(ValueError, match="outlier_mask"):
            Objective(cfg).prepare(b, None)


def test_positive_nll_weights_the_tokens_of_better_than_average_samples() -> None:
    b = batch()  # group 0: rewards 1 and 0; group 1: one sample (never better than its own mean)
    assert Objective(TrainConfig()).prepare(b, b.behaviour_logprobs).positive_weights is None
    o = Objective(TrainConfig(positive_nll_coef=0.5))
    p = o.prepare(b, b.behaviour_logprobs)
    assert p.positive_weights is not None
    torch.testing.assert_close(p.positive_weights, T([[0.0, 1 / 3, 1 / 3, 1 / 3], [0.0] * 4, [0.0] * 4]))
    logp = (b.behaviour_logprobs - 0.5).requires_grad_()
    loss, metrics = o.loss_fn(p)(b, slice(0, 3), Logprobs(logp, None))
    assert metrics["positive_nll"] == pytest.approx(1.5)  # mean of -logp over row 0's three tokens
    loss.backward()
    assert logp.grad is not None
    plain = Objective(TrainConfig()).prepare(b, b.behaviour_logprobs)
    logp2 = (b.behaviour_logprobs - 0.5).requires_grad_()
    Objective(TrainConfig()).loss_fn(plain)(b, slice(0, 3), Logprobs(logp2, None))[0].backward()
    assert logp2.grad is not None
    # the NLL adds -coef / 3 to the gradient of each of row 0's tokens, and nothing elsewhere
    extra = logp.grad - logp2.grad
    torch.testing.assert_close(extra, T([[0.0, -1 / 6, -1 / 6, -1 / 6], [0.0] * 4, [0.0] * 4]))


def test_a_custom_advantage_function_replaces_the_estimator() -> None:
    b = batch()
    o = Objective(TrainConfig(loss="ppo", advantage_fn="custom_rl:advantages"))
    p = o.prepare(b, b.behaviour_logprobs)
    want = (b.rewards - 0.5)[:, None] * b.loss_mask
    torch.testing.assert_close(p.advantages, want)
    with pytest.raises(ValueError, match=r"train.advantage_fn returned \(1,\); expected a tensor of \(3,\)"):
        Objective(TrainConfig(advantage_fn="custom_rl:bad_shape")).prepare(b, b.behaviour_logprobs)
    with pytest.raises(ValueError, match=r"train\.advantage_fn: module 'custom_rl' has no 'advantagez'; did you mean"):
        Objective(TrainConfig(advantage_fn="custom_rl:advantagez"))


def test_a_custom_policy_loss_is_aggregated_like_the_recipes() -> None:
    b = batch()
    o = Objective(TrainConfig(loss="ppo", policy_loss_fn="custom_rl:reinforce"))
    p = o.prepare(b, b.behaviour_logprobs)
    logp = (b.behaviour_logprobs - 0.3).requires_grad_()
    loss, _ = o.loss_fn(p)(b, slice(0, 3), Logprobs(logp, None))
    want = -(p.advantages * logp.detach() * p.weights).sum()  # ppo: no behaviour correction (weights 1)
    torch.testing.assert_close(loss.detach(), want)
    loss.backward()
    torch.testing.assert_close(logp.grad, -p.advantages * p.weights)


def test_sapo_through_the_objective() -> None:
    o = Objective(TrainConfig(loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0))
    assert (o.policy, o.advantage, o.aggregation, o.correction) == ("sapo", "grpo", "seq_mean_token_mean", "token")
    b = batch()
    shift = T([[0.0, math.log(3.0), 0.0, math.log(0.5)], [0.0] * 4, [0.0] * 4])  # proximal/behaviour weights

    def grad(obj: Objective, moved: torch.Tensor) -> torch.Tensor:
        """The gradient of one step at current = proximal + `moved`; proximal = behaviour + shift."""
        p = obj.prepare(b, b.behaviour_logprobs + shift)
        logp = (b.behaviour_logprobs + shift + moved).requires_grad_()
        loss, _ = obj.loss_fn(p)(b, slice(0, 3), Logprobs(logp, None))
        loss.backward()
        assert logp.grad is not None
        return logp.grad

    # at ratio 1 it is decoupled PPO's gradient (the same advantages, behaviour weights and aggregation)
    ppo = Objective(TrainConfig(loss="decoupled_ppo", aggregation="seq_mean_token_mean"))
    torch.testing.assert_close(grad(o, torch.zeros(3, 4)), grad(ppo, torch.zeros(3, 4)))
    # away from it the configured temperatures gate it: row 0 (A > 0) at ratio 1.5 weighs sech^2(2 * 0.5 / 2),
    # row 1 (A < 0) at ratio 1.5 sech^2(3 * 0.5 / 2); PPO's clip would have zeroed row 0 and kept row 1 whole
    moved = T([[0.0, math.log(1.5), math.log(1.5), math.log(1.5)], [0.0, math.log(1.5), math.log(1.5), 0.0], [0.0] * 4])
    ratio_one = grad(o, torch.zeros(3, 4))
    gated = grad(o, moved)
    sech2 = [1 / math.cosh(x) ** 2 for x in (0.5, 0.75)]
    torch.testing.assert_close(gated[0, 1:], ratio_one[0, 1:] * 1.5 * sech2[0])
    torch.testing.assert_close(gated[1, 1:3], ratio_one[1, 1:3] * 1.5 * sech2[1])
    with pytest.raises(msgspec.ValidationError, match="clip_high: the sapo recipe has no clip"):
        msgspec.convert({"loss": "sapo", "clip_high": 0.28}, TrainConfig)
