"""Each loss, correction, penalty and aggregation against a hand-computed reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from slime_async.train.losses import (
    aggregate,
    aggregation_weights,
    behaviour_weights,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    masked_mean,
    off_policy_metrics,
    outlier_mask,
    ppo_clip_loss,
    sapo_loss,
)

T = torch.tensor
ln = math.log


def test_ppo_clip_by_hand() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -2, -2; clip 0.2
    old = torch.zeros(1, 4)
    logp = T([[ln(1.5), ln(0.5), ln(1.1), ln(0.7)]])
    adv = T([[1.0, 1.0, -2.0, -2.0]])
    out = ppo_clip_loss(logp, old, adv, torch.ones(1, 4), 0.2, 0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5;
    # token 2: max(2.2, 2.2) = 2.2; token 3: max(1.4, 1.6) = 1.6 (clipped)
    torch.testing.assert_close(out.loss, T([[-1.2, -0.5, 2.2, 1.6]]))
    assert out.clipped.tolist() == [[True, False, False, True]]


def test_clip_higher_and_dual_clip() -> None:
    old = torch.zeros(1, 3)
    logp = T([[ln(1.25), ln(5.0), ln(0.5)]])
    adv = T([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    out = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # token 0 is under 1.28: not clipped, loss -1.25; token 1: max(5, 1.28) = 5; token 2: max(0.5, 0.8) = 0.8
    torch.testing.assert_close(out.loss, T([[-1.25, 5.0, 0.8]]))
    dual = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(dual.loss, T([[-1.25, 3.0, 0.8]]))  # 5 capped at -c*A = 3
    assert dual.clipped.tolist() == [[False, True, True]]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_gradient_is_zero_on_clipped_tokens() -> None:
    logp = T([[ln(1.5), ln(1.1)]], requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(1, 2), T([[1.0, 1.0]]), torch.ones(1, 2))
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, T([[0.0, -1.1]]))  # d(-r)/dlogp = -r


def test_masked_tokens_contribute_nothing_even_if_garbage() -> None:
    logp = T([[0.0, float("inf")], [float("nan"), -1e30]])
    old = T([[0.0, -float("inf")], [0.0, 0.0]])
    mask = T([[1.0, 0.0], [0.0, 0.0]])
    for out in (ppo_clip_loss(logp, old, torch.ones(2, 2), mask), gspo_loss(logp, old, torch.ones(2, 2), mask),
                cispo_loss(logp, old, torch.ones(2, 2), mask), sapo_loss(logp, old, torch.ones(2, 2), mask)):
        assert torch.isfinite(out.loss).all()
        assert out.loss[0, 1] == 0 and out.loss[1].abs().sum() == 0
    w = aggregation_weights(mask, "seq_mean_token_mean")
    assert aggregate(ppo_clip_loss(logp, old, torch.ones(2, 2), mask).loss, w).item() == -1.0


def test_gspo_uses_one_ratio_per_sequence_and_its_gradient() -> None:
    # sequence 0: log-ratios 0.2, 0.0 over 2 trained tokens (third masked) -> s = exp(0.1)
    old = torch.zeros(2, 3)
    logp = T([[0.2, 0.0, 7.0], [ln(2.0), ln(2.0), ln(2.0)]], requires_grad=True)
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = T([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    out = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(0.1)
    torch.testing.assert_close(out.ratio[0, :2], T([s0, s0]))
    torch.testing.assert_close(out.loss, T([[-s0, -s0, 0.0], [-1.2, -1.2, -1.2]]))  # seq 1 clipped at 1.2
    assert out.clipped[1].all() and not out.clipped[0].any()
    aggregate(out.loss, aggregation_weights(mask, "seq_mean_token_mean")).backward()
    # GSPO: grad of -s*A wrt logp_t is -s * A / |y| per token, then / N sequences (2)
    torch.testing.assert_close(logp.grad, T([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [0.0, 0.0, 0.0]]))


def test_cispo_keeps_gradient_through_clipped_tokens() -> None:
    old = torch.zeros(1, 2)
    logp = T([[ln(8.0), ln(0.5)]], requires_grad=True)
    out = cispo_loss(logp, old, T([[1.0, -1.0]]), torch.ones(1, 2), clip_low=1.0, clip_high=3.0)
    # weights: min(8, 4) = 4 (clipped), 0.5; loss = -w * A * logp
    torch.testing.assert_close(out.loss, T([[-4.0 * ln(8.0), 0.5 * ln(0.5)]]))
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, T([[-4.0, 0.5]]))
    assert out.clipped.tolist() == [[True, False]]


def test_sapo_by_hand_and_its_gradient_at_ratio_one_is_the_policy_gradient() -> None:
    # loss = -(4 / tau) sigmoid(tau (r - 1)) A, tau = 1 for A > 0 and 2 for A <= 0
    old = torch.zeros(1, 4)
    logp = T([[0.0, ln(3.0), 0.0, ln(0.5)]], requires_grad=True)
    adv = T([[2.0, 1.0, -1.0, -1.0]])
    out = sapo_loss(logp, old, adv, torch.ones(1, 4), tau_pos=1.0, tau_neg=2.0)

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    torch.testing.assert_close(out.loss, T([[-4 * 0.5 * 2.0, -4 * sig(2.0), 2 * 0.5, 2 * sig(-1.0)]]))
    out.loss.sum().backward()
    assert logp.grad is not None
    # d/dlogp = -A r (4 s (1 - s)), s = sigmoid(tau (r - 1)): at r = 1, -A, whatever tau (REINFORCE's gradient)
    want = [-2.0, -1.0 * 3.0 * 4 * sig(2.0) * sig(-2.0), 1.0, 0.5 * 4 * sig(-1.0) * sig(1.0)]
    torch.testing.assert_close(logp.grad, T([want]))
    # the gate halved only the gradient of the token at ratio 3 (tau |r - 1| = 2 > 1.76)
    assert out.clipped.tolist() == [[False, True, False, False]]
    with pytest.raises(ValueError, match="temperatures"):
        sapo_loss(logp, old, adv, torch.ones(1, 4), tau_neg=0.0)


def test_sapo_gate_fades_smoothly_and_faster_for_negative_advantages() -> None:
    ratios = [0.5, 0.8, 0.95, 1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 5.0]
    n = len(ratios)

    def gate(adv: float, **kw: float) -> list[float]:
        """The gradient's weight against the unclipped surrogate's (-A r) at each ratio."""
        logp = T([[ln(r) for r in ratios]], requires_grad=True)
        sapo_loss(logp, torch.zeros(1, n), torch.full((1, n), adv), torch.ones(1, n), **kw).loss.sum().backward()
        assert logp.grad is not None
        return (logp.grad / T([[-adv * r for r in ratios]]))[0].tolist()

    up, down = gate(1.0, tau_pos=1.0, tau_neg=1.05), gate(-1.0, tau_pos=1.0, tau_neg=1.05)
    one = ratios.index(1.0)
    assert up[one] == pytest.approx(1.0) and down[one] == pytest.approx(1.0)
    # it falls on either side of 1, step by step (no band, no jump: PPO's gradient drops from whole to 0)
    for w in (up, down):
        assert all(a < b for a, b in itertools.pairwise(w[:one + 1]))
        assert all(a > b for a, b in itertools.pairwise(w[one:]))
        assert w[-1] > 0  # never zero: far tokens still teach, a little
        neighbours = [abs(a - b) for a, b in itertools.pairwise(w)]
        assert max(neighbours[one - 1:one + 1]) < 0.01  # a 5% step from ratio 1 changes it by under 1%
    # the negative side's higher temperature fades its gradient sooner, at every ratio but 1
    assert all(d < u for i, (d, u) in enumerate(zip(down, up, strict=True)) if i != one)
    # and a higher temperature narrows the gate: halved by ratio 2 with tau 2, not with tau 1
    assert gate(1.0, tau_pos=2.0)[ratios.index(2.0)] < 0.5 < up[ratios.index(2.0)]


def test_behaviour_weights_token_and_sequence_capped() -> None:
    prox = T([[ln(0.5), ln(0.9), 0.0], [ln(0.2), ln(0.2), 0.0]])
    behav = T([[ln(0.25), ln(0.9), 5.0], [ln(0.4), ln(0.4), 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tok = behaviour_weights(prox, behav, mask, "token", cap=1.5)
    torch.testing.assert_close(tok, T([[1.5, 1.0, 0.0], [0.5, 0.5, 1.0]]))  # 2.0 capped at 1.5
    seq = behaviour_weights(prox, behav, mask, "sequence", cap=1.5)
    torch.testing.assert_close(seq, T([[1.5, 1.5, 0.0], [0.25, 0.25, 0.25]]))
    assert torch.equal(behaviour_weights(prox, behav, mask, "none"), mask)
    assert not behaviour_weights(prox.requires_grad_(), behav, mask).requires_grad


def test_outlier_mask_token_and_sequence() -> None:
    prox = T([[0.0, ln(3.0), 0.0], [ln(0.9), 0.0, 0.0]])
    behav = torch.zeros(2, 3)
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert outlier_mask(prox, behav, mask, "token").tolist() == [[1, 0, 1], [1, 1, 0]]
    assert outlier_mask(prox, behav, mask, "sequence").tolist() == [[0, 0, 0], [1, 1, 0]]
    assert torch.equal(outlier_mask(prox, behav, mask, "none"), mask)
    with pytest.raises(ValueError, match="outlier bounds"):
        outlier_mask(prox, behav, mask, "token", low=2.0)


def test_kl_estimators() -> None:
    logp = T([[ln(0.5), ln(0.2)]])
    ref = T([[ln(0.25), ln(0.4)]])
    mask = T([[1.0, 1.0]])
    x = [ln(2.0), ln(0.5)]
    torch.testing.assert_close(kl_penalty(logp, ref, mask, "k1"), T([x]))
    torch.testing.assert_close(kl_penalty(logp, ref, mask, "k2"), T([[v * v / 2 for v in x]]))
    torch.testing.assert_close(kl_penalty(logp, ref, mask, "k3"), T([[math.exp(-v) - 1 + v for v in x]]))
    assert kl_penalty(logp, ref, T([[0.0, 0.0]]), "k3").abs().sum() == 0


def test_entropy() -> None:
    logits = T([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(entropy_from_logits(logits), T([ln(4.0), 0.0]), atol=1e-6, rtol=0)


def test_aggregations_by_hand() -> None:
    values = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0], [5.0, 7.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # row 2 all masked
    groups = T([0, 0, 1, 1])

    def agg(mode: str, **kw: object) -> float:
        return aggregate(values, aggregation_weights(mask, mode, **kw)).item()

    assert agg("token_mean") == pytest.approx((1 + 2 + 3 + 4 + 5 + 7) / 6)
    assert agg("seq_mean_token_mean") == pytest.approx((2.0 + 4.0 + 6.0) / 3)  # row 2 not counted
    assert agg("seq_mean_token_sum_norm", norm=4) == pytest.approx((6 / 4 + 4 / 4 + 12 / 4) / 3)
    # group 0: tokens 1,2,3,4 -> mean 2.5; group 1: 5,7 -> 6
    assert agg("group_mean", group_index=groups) == pytest.approx((2.5 + 6.0) / 2)
    assert aggregate(values, aggregation_weights(torch.zeros(4, 3), "seq_mean_token_mean")).item() == 0.0
    with pytest.raises(ValueError, match="norm"):
        agg("seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="group_index"):
        agg("group_mean")


def test_aggregation_over_micro_batches_adds_up() -> None:
    values = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    mask = (torch.rand(6, 5, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    w = aggregation_weights(mask, "seq_mean_token_mean")
    whole = aggregate(values, w)
    parts = aggregate(values[:2], w[:2]) + aggregate(values[2:], w[2:])
    torch.testing.assert_close(whole, parts)


def test_metrics_by_hand() -> None:
    prox = T([[ln(0.5), ln(0.2), 0.0]])
    behav = T([[ln(0.25), ln(0.2), 0.0]])
    logp = T([[ln(0.5) + ln(1.5), ln(0.2), 3.0]])
    mask = T([[1.0, 1.0, 0.0]])
    clipped = T([[True, False, True]])
    m = off_policy_metrics(logp, prox, behav, mask, clipped)
    assert m["tokens"] == 2
    assert m["clip_fraction"] == 0.5
    assert m["ratio_mean"] == pytest.approx(1.25) and m["ratio_max"] == pytest.approx(1.5)
    assert m["ratio_min"] == pytest.approx(1.0) and m["ratio_std"] == pytest.approx(0.25)
    assert m["behav_prox_kl_k1"] == pytest.approx(-ln(2.0) / 2)
    assert m["behav_prox_kl_k3"] == pytest.approx((2 - 1 - ln(2.0)) / 2)
    assert m["max_abs_dp"] == pytest.approx(0.25)
    assert m["ess"] == pytest.approx((2 + 1) ** 2 / (2 * (4 + 1)))
    assert m["behav_prox_abs_dlogp"] == pytest.approx(ln(2.0) / 2)
    assert m["behav_ratio_out"] == 0.5  # prox/behav 2 and 1
    empty = off_policy_metrics(logp, prox, behav, torch.zeros(1, 3))
    assert empty["tokens"] == 0 and empty["ess"] == 1.0
    assert masked_mean(T([1.0, float("nan")]), T([1.0, 0.0])).item() == 1.0
