"""The configured objective: which advantage, policy loss, correction and aggregation, composed.

`TrainConfig.loss` names a recipe (the defaults below); `advantage`, `aggregation`, `clip_low`,
`clip_high` override single parts of it. Everything that does not depend on the current weights
(advantages, corrected mask, behaviour weights, aggregation weights, reference logprobs) is computed
once per batch in `prepare`; `loss` is then called per micro-batch by the backend.

With one optimizer step per batch, the proximal policy (the weights before the step) is the policy
of the training forward itself, so its logprobs are that forward's, detached: `prepare` without
`prox` leaves them (and the behaviour weights built on them) to the loss, which saves a whole
forward pass per step (a quarter of the torch backend's step on CPU). It is the same quantity, not
an approximation; `can_fuse_proximal` says when nothing else needs the proximal logprobs earlier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_async.config.schema import TrainConfig
from slime_async.train import advantages as A
from slime_async.train import losses as L
from slime_async.train.backend import Logprobs
from slime_async.train.batch import Batch


@dataclass(frozen=True)
class Recipe:
    policy: str
    """ppo | gspo | cispo | sapo"""
    advantage: str
    aggregation: str
    clip_low: float
    clip_high: float
    """The ratio clip (`sapo` has none: its gate's width is `train.sapo_tau_pos/neg`)."""
    behaviour_correction: bool
    """Whether `train.behaviour_correction` applies (all but plain `ppo`)."""


RECIPES: dict[str, Recipe] = {
    "grpo": Recipe("ppo", "grpo", "seq_mean_token_mean", 0.2, 0.2, True),
    "dr_grpo": Recipe("ppo", "dr_grpo", "seq_mean_token_sum_norm", 0.2, 0.2, True),
    "gspo": Recipe("gspo", "grpo", "seq_mean_token_mean", 3e-4, 4e-4, True),
    "cispo": Recipe("cispo", "grpo", "token_mean", 1.0, 5.0, True),
    # SAPO changes only the per-token term: GRPO's advantages and aggregation, as `grpo`; no clip
    "sapo": Recipe("sapo", "grpo", "seq_mean_token_mean", 0.0, 0.0, True),
    "ppo": Recipe("ppo", "grpo", "token_mean", 0.2, 0.2, False),
    "decoupled_ppo": Recipe("ppo", "grpo", "token_mean", 0.2, 0.2, True),
}


@dataclass
class Prepared:
    """Per-batch inputs of the loss, all [N, T] (or [N]) on CPU."""

    mask: torch.Tensor
    prox: torch.Tensor
    behav: torch.Tensor
    advantages: torch.Tensor
    behaviour_weights: torch.Tensor
    weights: torch.Tensor
    """Aggregation weights: the loss is sum(values * weights)."""
    ref_logp: torch.Tensor | None
    current: torch.Tensor
    """Filled during the step: the current policy's logprobs (for metrics)."""
    clipped: torch.Tensor
    fused: bool = False
    """`prox` and `behaviour_weights` are filled by the loss from the training forward."""
    positive_weights: torch.Tensor | None = None
    """Token-mean weights over the tokens of sequences better than their group's mean (the
    positive-example NLL term); None when `train.positive_nll_coef` is 0."""
    distill: dict[str, float] = field(default_factory=dict)
    """On-policy distillation's batch metrics (`distill/reverse_kl` over the scored tokens,
    `distill/scored_fraction` of the trained tokens); empty when not distilling."""
    pending: list[tuple[torch.Tensor, slice, int, torch.Tensor]] = field(default_factory=list)
    """Device results of the loss waiting to be copied into the CPU tensors above (`settle`): a copy
    per micro-batch would make the host wait for the GPU before it can queue the backward pass."""

    _on: dict[torch.device, dict[str, torch.Tensor | None]] = field(default_factory=dict)

    def on(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """The loss's inputs on `device`, copied once per batch from pinned memory without waiting (a
        copy from ordinary memory per micro-batch made the host wait for the GPU each time)."""
        if device not in self._on:
            def move(t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None or device.type != "cuda":
                    return t
                return t.contiguous().pin_memory().to(device, non_blocking=True)

            self._on[device] = {name: move(getattr(self, name)) for name in (
                "mask", "prox", "behav", "advantages", "behaviour_weights", "weights", "ref_logp",
                "positive_weights")}
        return self._on[device]

    def settle(self) -> None:
        """Copy what the loss left on the device into `prox`, `behaviour_weights`, `current` and `clipped`."""
        for target, rows, k, value in self.pending:
            target[rows, :k] = value.cpu()
        self.pending.clear()


class Objective:
    def __init__(self, cfg: TrainConfig) -> None:
        recipe = RECIPES[cfg.loss]
        self.cfg = cfg
        self.policy = recipe.policy
        self.advantage = cfg.advantage or recipe.advantage
        self.aggregation = cfg.aggregation or recipe.aggregation
        self.clip_low = cfg.clip_low if cfg.clip_low is not None else recipe.clip_low
        self.clip_high = cfg.clip_high if cfg.clip_high is not None else recipe.clip_high
        self.correction = cfg.behaviour_correction if recipe.behaviour_correction else "none"
        self.norm = float(cfg.aggregation_norm or cfg.max_seq_len)
        self.advantage_fn = _function(cfg.advantage_fn, "train.advantage_fn", "my_rl:advantages")
        self.policy_loss_fn = _function(cfg.policy_loss_fn, "train.policy_loss_fn", "my_rl:policy_loss")

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0

    @property
    def can_fuse_proximal(self) -> bool:
        """Whether `prepare` can run without proximal logprobs: only the loss needs them (no outlier
        mask and no KL reward, which shape the whole batch before any micro-batch runs)."""
        cfg = self.cfg
        return cfg.outlier_mask == "none" and not (cfg.kl_coef > 0 and cfg.kl_in == "reward")

    def prepare(self, batch: Batch, prox: torch.Tensor | None, ref_logp: torch.Tensor | None = None) -> Prepared:
        """The batch's loss inputs. `prox` None: the loss takes it from the training forward (one
        optimizer step on this batch, and `can_fuse_proximal`)."""
        behav = batch.behaviour_logprobs
        if prox is None:
            if not self.can_fuse_proximal:
                raise ValueError("proximal logprobs are needed before the step with train.outlier_mask or "
                                 "train.kl_in=reward; recompute them first")
            return self._prepare(batch, torch.zeros_like(behav), ref_logp, fused=True)
        return self._prepare(batch, prox, ref_logp, fused=False)

    def _prepare(self, batch: Batch, prox: torch.Tensor, ref_logp: torch.Tensor | None, fused: bool) -> Prepared:
        cfg = self.cfg
        behav = batch.behaviour_logprobs
        mask = L.outlier_mask(prox, behav, batch.loss_mask, cfg.outlier_mask, cfg.outlier_low, cfg.outlier_high)
        token_rewards = None
        if cfg.kl_coef > 0 and cfg.kl_in == "reward":
            if ref_logp is None:
                raise ValueError("train.kl_in=reward needs reference logprobs")
            # the penalty of the sampled tokens, under the policy that is about to be updated
            token_rewards = A.reward_to_go(-cfg.kl_coef * L.kl_penalty(prox, ref_logp, mask, cfg.kl_estimator), mask)
        if self.advantage_fn is not None:
            adv = _custom_advantages(self.advantage_fn, batch, mask)
            if token_rewards is not None:
                adv = adv + token_rewards
        elif self.advantage == "reinforce_pp":
            adv = A.reinforce_pp_baseline_advantages(batch.rewards, batch.group_index, mask, token_rewards)
        else:
            seq = A.grpo_advantages(batch.rewards, batch.group_index, normalize_std=self.advantage == "grpo")
            adv = A.to_tokens(seq, mask)
            if token_rewards is not None:
                adv = adv + token_rewards
        distill: dict[str, float] = {}
        if cfg.distilling:
            adv, distill = self._distill(batch, mask, adv)
        positive = None
        if cfg.positive_nll_coef > 0:
            better = A.group_mean(batch.rewards, batch.group_index) < batch.rewards
            positive = mask * better[:, None].to(mask.dtype)
            positive = positive / positive.sum().clamp(min=1.0)
        return Prepared(
            mask=mask,
            prox=prox,
            behav=behav,
            advantages=adv,
            behaviour_weights=(torch.zeros_like(mask) if fused
                               else L.behaviour_weights(prox, behav, mask, self.correction, cfg.behaviour_cap)),
            weights=L.aggregation_weights(mask, self.aggregation, batch.group_index, self.norm),  # type: ignore[arg-type]
            ref_logp=ref_logp,
            current=torch.zeros_like(prox),
            clipped=torch.zeros_like(mask, dtype=torch.bool),
            fused=fused,
            positive_weights=positive,
            distill=distill,
        )

    def _distill(self, batch: Batch, mask: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """On-policy distillation's per-token reverse KL in the advantages, and its metrics.

        On a token x sampled from the student, log pi(x) - log q(x) (pi the student, q the teacher) is
        the one-sample estimate of KL(pi || q) at that position, and the gradient of the reverse KL is
        E[(log pi - log q) grad log pi]: a policy gradient with the per-token advantage -(log pi - log q),
        taken through the same clipped, behaviour-corrected surrogate as the task's (so stale tokens are
        corrected alike). log pi is the sampler's (behaviour) logprob, as in Thinking Machines' recipe:
        known before the step. Tokens the teacher did not score get no term."""
        d = self.cfg.distill
        if not d.task_reward:
            adv = torch.zeros_like(adv)
        if batch.teacher_logprobs is None or batch.teacher_mask is None:
            return adv, {"distill/scored_fraction": 0.0}
        scored = mask * batch.teacher_mask
        reverse_kl = torch.where(scored.bool(), batch.behaviour_logprobs - batch.teacher_logprobs,
                                 torch.zeros_like(adv))
        n = float(scored.sum())
        return adv - d.coef * reverse_kl, {
            "distill/reverse_kl": float(reverse_kl.sum()) / max(n, 1.0),
            "distill/scored_fraction": n / max(float(mask.sum()), 1.0),
        }

    def loss_fn(self, prep: Prepared):  # -> LossFn
        """The per-micro-batch loss over `prep`, for `TrainerBackend.train_step`."""
        cfg = self.cfg

        def fn(mb: Batch, rows: slice, out: Logprobs) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
            logp = out.logprobs
            dev = logp.device
            k = logp.shape[1]
            inputs = prep.on(dev)

            def part(name: str) -> torch.Tensor:
                t = inputs[name]
                assert t is not None
                return t[rows, :k].to(dev)

            mask, adv, weights = part("mask"), part("advantages"), part("weights")
            if prep.fused:  # these weights are the proximal policy: see the module's docstring
                prox = logp.detach()
                behaviour_weights = L.behaviour_weights(prox, part("behav"), mask, self.correction,
                                                        cfg.behaviour_cap)
                prep.pending += [(prep.prox, rows, k, prox), (prep.behaviour_weights, rows, k, behaviour_weights)]
            else:
                prox, behaviour_weights = part("prox"), part("behaviour_weights")
            if self.policy_loss_fn is not None:
                pl = _custom_policy_loss(self.policy_loss_fn, logp, prox, adv, mask, self.clip_low, self.clip_high)
            elif self.policy == "gspo":
                pl = L.gspo_loss(logp, prox, adv, mask, self.clip_low, self.clip_high)
            elif self.policy == "cispo":
                pl = L.cispo_loss(logp, prox, adv, mask, self.clip_low, self.clip_high)
            elif self.policy == "sapo":
                pl = L.sapo_loss(logp, prox, adv, mask, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
            else:
                pl = L.ppo_clip_loss(logp, prox, adv, mask, self.clip_low, self.clip_high, cfg.dual_clip)
            values = pl.loss * behaviour_weights
            pg = L.aggregate(values, weights)
            loss = pg
            # metrics stay on the device until the step's end (`metric_floats`): no host sync per micro-batch
            metrics = {"pg_loss": pg.detach()}
            if cfg.kl_coef > 0 and cfg.kl_in == "loss":
                assert prep.ref_logp is not None
                kl = L.aggregate(L.kl_penalty(logp, part("ref_logp"), mask, cfg.kl_estimator), weights)
                loss = loss + cfg.kl_coef * kl
                metrics["kl_ref"] = kl.detach()
            if prep.positive_weights is not None:
                # VAPO's positive-example LM loss: GRPO's advantages sum to zero in a group, so the
                # rare tokens no sample chose get no steady push; the NLL of the better samples
                # keeps lowering them, as the supervised warm-start did
                nll = -L.aggregate(logp, part("positive_weights"))
                loss = loss + cfg.positive_nll_coef * nll
                metrics["positive_nll"] = nll.detach()
            if cfg.entropy_coef > 0:
                assert out.entropy is not None
                ent = L.aggregate(out.entropy, weights)
                loss = loss - cfg.entropy_coef * ent
                metrics["entropy"] = ent.detach()
            prep.pending += [(prep.current, rows, k, logp.detach()), (prep.clipped, rows, k, pl.clipped)]
            return loss, metrics

        return fn

    def metrics(self, prep: Prepared) -> dict[str, float]:
        """Off-policy health over the batch (ratio of current to proximal as it was at the step's start)."""
        prep.settle()
        return {**L.off_policy_metrics(prep.current, prep.prox, prep.behav, prep.mask, prep.clipped), **prep.distill}


def _function(name: str | None, setting: str, example: str) -> Callable[..., Any] | None:
    if name is None:
        return None
    from slime_async.env.loading import import_named

    fn = import_named(name, setting, example, kind="function")
    if not callable(fn):
        raise ValueError(f"{setting}: {name} is not a function")
    return fn


def _custom_advantages(fn: Callable[..., Any], batch: Batch, mask: torch.Tensor) -> torch.Tensor:
    """`train.advantage_fn`'s advantages as [N, T] float32 on the trained tokens; a ValueError naming the
    setting when they are not a tensor of [N] or [N, T], or not finite."""
    out = fn(batch.rewards.clone(), batch.group_index.clone(), mask.clone())
    if not isinstance(out, torch.Tensor) or out.shape not in (mask.shape[:1], mask.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"train.advantage_fn returned {shape}; expected a tensor of {tuple(mask.shape[:1])} "
                         f"(per sequence) or {tuple(mask.shape)} (per token)")
    out = out.detach().to(torch.float32).cpu()
    if not torch.isfinite(out).all():
        raise ValueError("train.advantage_fn returned non-finite advantages")
    return A.to_tokens(out, mask) if out.dim() == 1 else out * mask.to(torch.float32)


def _custom_policy_loss(fn: Callable[..., Any], logp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float) -> L.PolicyLoss:
    out = fn(logp, prox, adv, mask, clip_low, clip_high)
    loss, clipped = (out.loss, out.clipped) if hasattr(out, "loss") else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"train.policy_loss_fn returned {shape}; expected a per-token loss of {tuple(logp.shape)}")
    if clipped is None:
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    m = mask.bool()
    ratio = torch.exp(torch.where(m, logp.detach() - prox, torch.zeros_like(prox)))
    return L.PolicyLoss(loss=torch.where(m, loss, torch.zeros_like(loss)), clipped=clipped.bool() & m, ratio=ratio)
