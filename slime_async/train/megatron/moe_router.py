"""The Megatron backend's MoE router: Qwen3-MoE's routing, per-token routing replay and the router losses.

`QwenRouter` replaces Megatron's `TopKRouter.gating` and `.routing` (it is set in the layer spec, so
nothing of Megatron's is patched and other backends in the process are untouched):
- logits = hidden @ weight.T in the hidden dtype, as `Qwen3MoeTopKRouter` computes them (Megatron's
  `moe_router_dtype="fp32"` would compute them in float32, unlike HF and the engines; and its gating
  function names Transformer Engine's GEMM unconditionally in megatron-core 0.16.1, a NameError
  without TE);
- probs = softmax(logits in float32) over all experts; experts = top-k of probs; weights = the
  probs at those experts, renormalised to sum to 1 when `norm_topk_prob`: exactly
  `Qwen3MoeTopKRouter` (Megatron's own pre-/post-softmax top-k computes the same weights, but only
  up to rounding when renormalising);
- replay: a token whose record for this layer holds k valid, distinct expert ids goes to those
  experts, weighted by the probs gathered there (so the router still gets gradients); a token without
  one (-1, or a malformed row) is routed by the model itself. Megatron's `RouterReplay` replays all
  tokens or none, and keeps its instances in a class-level list shared by every model of the process;
- the load-balancing and z losses of the contract (per layer over the micro-batch's real tokens:
  aux = E * sum_e f_e * P_e with f_e over the experts actually used, replayed or not;
  z = mean logsumexp(logits)^2), weighted by the micro-batch's share of the batch's real tokens and
  attached to the routing weights by `_AttachLoss` (its gradient enters backward wherever the layer
  runs, on any pipeline stage). Megatron's own aux losses are switched off: they count padding
  unless given its padding mask, use a fresh top-k instead of the replayed experts, and rescale by
  local token counts for a `finalize_model_grads(num_tokens=...)` division that this backend never
  asks for (its loss shares already weigh the batch).

Under sequence parallelism (tensor parallelism with MoE) a router sees its tensor-parallel rank's part
of the sequence: it reads that part of the record and the mask, and the losses' sums (expert counts,
probabilities, z, real tokens) are all-reduced over the tensor-parallel ranks before they are
combined, so every rank computes the whole micro-batch's losses (the reduction's backward passes each
rank's gradient to its own tokens).

The routers of a model read one `RouteFeed`, which the backend fills for each micro-batch before its
forward. Under full activation recomputation (GPU) a layer's forward runs twice in training: first
without gradients, then again during backward, possibly after later micro-batches' forwards (the
pipeline schedule); the feed keeps what each layer's first pass read in a queue for the second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

from slime_async.moe.replay import moved_rows, usable_routes


@dataclass
class _MicroBatch:
    routes: torch.Tensor | None
    """[b, s, layers x k] int64 recorded experts (-1: none), or None: no replay."""
    real: torch.Tensor
    """[b, s] bool: real (non-padding) tokens."""
    share: torch.Tensor | float
    """The micro-batch's share of the batch's real tokens (weighs its router losses)."""


class RouteFeed:
    """What the routers of one backend read: the current micro-batch, the loss coefficients, and
    the sums of the router losses over a train step."""

    def __init__(self, num_layers: int, aux_coef: float, z_coef: float, device: torch.device,
                 sequence_parallel: tuple[int, Any] | None = None) -> None:
        self.sequence_parallel = sequence_parallel
        """(this rank's place, the group) of the sequence's parts: the tensor-parallel ranks; None: whole sequences."""
        self.num_layers = num_layers
        self.aux_coef = aux_coef
        self.z_coef = z_coef
        self.device = device
        self.current: _MicroBatch | None = None
        self.training = False
        """True inside a train step: the router losses are attached and summed."""
        self.recompute: dict[int, deque[_MicroBatch | None]] = {}
        """Per layer: what its checkpointed first passes read, for their recomputation in backward."""
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)
        """(loss term, aux metric, z metric, replayed (token, layer) routes that differ from the model's own
        choice, replayed routes) summed over this rank's layers and micro-batches."""

    def begin_step(self) -> None:
        self.training = True
        self.sums.zero_()
        self.recompute.clear()

    def end_step(self) -> None:
        self.training = False
        self.current = None
        self.recompute.clear()

    def feed(self, routes: torch.Tensor | None, attention_mask: torch.Tensor, share: torch.Tensor | float) -> None:
        """The next forward's micro-batch: its recorded experts (None: no replay), mask and token share."""
        if routes is not None:
            routes = routes.to(self.device, torch.int64)
        self.current = _MicroBatch(routes, attention_mask.to(self.device).bool(), share)


class _AttachLoss(torch.autograd.Function):
    """Identity on `output`; in backward, d(loss)/d(loss) = 1 joins the graph (as Megatron's
    MoEAuxLossAutoScaler does, without its process-wide scale)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class QwenRouter(TopKRouter):
    """Megatron's top-k router computing Qwen3-MoE's routing, with per-token replay and our router losses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.feed: RouteFeed | None = None

    def _micro_batch(self) -> _MicroBatch | None:
        feed = self.feed
        if feed is None or not feed.training or self.config.recompute_granularity != "full":
            return None if feed is None else feed.current
        queue = feed.recompute.setdefault(self.layer_number, deque())
        if not torch.is_grad_enabled():  # the checkpointed first pass: keep what it read for the second
            queue.append(feed.current)
            return feed.current
        return queue.popleft() if queue else feed.current

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(input, self.weight.to(input.dtype))

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        seq, bsz = logits.shape[:2]
        num_experts, k = self.config.num_moe_experts, self.topk
        logits = logits.reshape(-1, num_experts).float()
        probs = torch.softmax(logits, dim=-1)
        ids = torch.topk(probs, k, dim=-1).indices
        mb = self._micro_batch()
        layer = self.layer_number - 1  # global (Megatron counts from 1, across pipeline stages)
        replayed = None
        part = self._part(seq)
        if mb is not None and mb.routes is not None:
            # Megatron's tokens are [s, b] flattened; the record is [b, s]
            rec = mb.routes[:bsz, part, layer * k:(layer + 1) * k].transpose(0, 1).reshape(-1, k)
            usable = usable_routes(rec, num_experts)
            replayed = (usable, rec, ids)  # how many differ is counted by `_losses` (training passes only)
            ids = torch.where(usable[:, None], rec, ids)
        weights = probs.gather(1, ids)
        if not self.config.moe_router_pre_softmax:  # = norm_topk_prob (model.transformer_config)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(self.config.params_dtype)  # as HF casts them to the hidden dtype
        routing_probs = torch.zeros_like(probs, dtype=weights.dtype).scatter(1, ids, weights)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, True)
        feed = self.feed
        if (feed is not None and feed.training and mb is not None and self.training and torch.is_grad_enabled()):
            routing_probs = self._losses(feed, mb, logits, probs, ids, part, bsz, routing_probs, replayed)
        return routing_probs, routing_map

    def _part(self, seq: int) -> slice:
        """The sequence positions of this rank's `seq` tokens (all of them without sequence parallelism)."""
        sp = self.feed.sequence_parallel if self.feed is not None else None
        start = sp[0] * seq if sp is not None else 0
        return slice(start, start + seq)

    def _losses(self, feed: RouteFeed, mb: _MicroBatch, logits: torch.Tensor, probs: torch.Tensor,
                ids: torch.Tensor, part: slice, bsz: int, routing_probs: torch.Tensor,
                replayed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """This layer's aux and z losses over the real tokens, weighted by the micro-batch's share;
        summed into the feed and attached to `routing_probs` (when a coefficient is nonzero). Counts
        the replayed routes of real tokens and those that differ from the model's own top-k."""
        real = mb.real[:bsz, part].transpose(0, 1).reshape(-1)
        num_experts = probs.shape[1]
        counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
        # the mask multiplies rather than indexes: indexing by it would make the host wait for the GPU
        counts.index_add_(0, ids.reshape(-1), real.to(probs.dtype).repeat_interleave(ids.shape[1]))
        sums = torch.cat([counts, (probs * real[:, None]).sum(0),
                          (torch.logsumexp(logits, dim=-1).square() * real).sum()[None],
                          real.sum()[None].to(probs.dtype)])
        if feed.sequence_parallel is not None:  # the whole sequence's sums: forward all-reduce, backward identity
            from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

            sums = reduce_from_tensor_model_parallel_region(sums, group=feed.sequence_parallel[1])
        n = sums[-1].clamp(min=1)
        f = sums[:num_experts] / (n * self.topk)
        p = sums[num_experts:2 * num_experts] / n
        aux = num_experts * (f * p).sum()
        z = sums[-2] / n
        term = mb.share * (feed.aux_coef * aux + feed.z_coef * z)
        with torch.no_grad():
            recorded, differ = 0, 0
            if replayed:  # (usable rows, the record, the model's own top-k)
                usable, rec, own = replayed
                recorded, differ = (real & usable).sum(), moved_rows(rec, own, real & usable).sum()
            feed.sums += torch.stack([torch.as_tensor(v, dtype=feed.sums.dtype, device=feed.sums.device) for v in (
                term, mb.share * aux / feed.num_layers, mb.share * z / feed.num_layers, differ, recorded)])
        if feed.aux_coef or feed.z_coef:
            routing_probs = _AttachLoss.apply(routing_probs, term)
        return routing_probs

