"""The torch backend's MoE routers: routing replay and the router losses.

Each of the transformers model's top-k routers (`Qwen3MoeTopKRouter`) is given our own forward, the
same computation as transformers' (`slime_async.moe.shape` states it) with two additions:

- **Replay.** While a micro-batch's routed-experts record is set, a token with a record takes the
  engine's experts instead of its own top-k; their weights are still the router's softmax at those
  experts (renormalised like the model's), so the router's gradient flows as it would have, had it
  chosen them. A token without a usable record (-1, an id out of range, a repeated id) routes itself.
- **Losses.** While collecting, each layer's load-balancing loss (Switch Transformer's: experts x
  sum over experts of the fraction of top-k choices x the mean probability; 1.0 when balanced) and
  z-loss (mean squared logsumexp of the logits) over the micro-batch's real tokens are kept for the
  backend to add to the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slime_async.moe.replay import moved_rows, usable_routes
from slime_async.moe.shape import MoeShape


@dataclass
class RouterStats:
    """Sums over the layers of one forward (tensors on the device; None when not collected)."""

    aux: torch.Tensor | None
    """Load-balancing losses."""
    z: torch.Tensor | None
    """Router z-losses."""
    differ: torch.Tensor | None
    """(token, layer) pairs whose recorded experts differ from the ones this model would choose."""
    recorded: torch.Tensor | None
    """(token, layer) pairs with a record."""


class RouterControl:
    """Replay and losses for every router of one model (installed once, on construction)."""

    def __init__(self, model: torch.nn.Module, shape: MoeShape) -> None:
        self.shape = shape
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if len(routers) != shape.num_layers:
            raise ValueError(f"model.path: found {len(routers)} MoE routers in a model of {shape.num_layers} layers")
        for layer, router in enumerate(routers):
            # an instance attribute: nn.Module.__call__ looks `forward` up on the instance first
            router.forward = self._forward_of(router, layer)
        self.routes: torch.Tensor | None = None
        """[tokens, layers x top_k] int64 of the micro-batch in flight, -1 where unreported; None: no replay."""
        self.valid: torch.Tensor | None = None
        """[tokens] bool: the real (not padding) tokens the losses count; None: losses not collected."""
        self.aux: list[torch.Tensor] = []
        self.z: list[torch.Tensor] = []
        self.differ: list[torch.Tensor] = []
        self.recorded: list[torch.Tensor] = []

    def begin(self, routes: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Set up the next forward: `routes` [B, T, layers x top_k] (or None), `valid` [B, T] to collect
        the losses over (or None)."""
        k = self.shape.route_width
        self.routes = None if routes is None else routes.reshape(-1, k).long()
        self.valid = None if valid is None else valid.reshape(-1).bool()
        self.aux, self.z, self.differ, self.recorded = [], [], [], []

    def end(self) -> RouterStats:
        """The router losses of the forward just run (None when not collected); clears the replay."""
        stats = RouterStats(
            aux=torch.stack(self.aux).sum() if self.aux else None,
            z=torch.stack(self.z).sum() if self.z else None,
            differ=torch.stack(self.differ).sum() if self.differ else None,
            recorded=torch.stack(self.recorded).sum() if self.recorded else None,
        )
        self.routes, self.valid, self.aux, self.z, self.differ, self.recorded = None, None, [], [], [], []
        return stats

    def _forward_of(self, router: torch.nn.Module, layer: int) -> Any:
        shape = self.shape
        lo, hi = layer * shape.top_k, (layer + 1) * shape.top_k

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = hidden_states.reshape(-1, router.weight.shape[1])
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights, experts = torch.topk(probs, shape.top_k, dim=-1)
            if self.routes is not None:
                record = self.routes[:, lo:hi]
                known = usable_routes(record, shape.num_experts)[:, None]  # the rest route themselves
                if self.valid is not None:  # how often the engine chose other experts than we would
                    counted = known[:, 0] & self.valid
                    self.differ.append(moved_rows(record, experts, counted).sum())
                    self.recorded.append(counted.sum())
                experts = torch.where(known, record, experts)
                weights = probs.gather(1, experts)
            if shape.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if self.valid is not None:
                self._losses(logits, probs, experts)
            return logits, weights.to(logits.dtype), experts

        return forward

    def _losses(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> None:
        assert self.valid is not None
        # masks multiply rather than index: indexing by a boolean mask makes the host wait for the GPU
        valid = self.valid.to(probs.dtype)
        n = valid.sum().clamp(min=1)
        k = self.shape.top_k
        chosen = torch.zeros(self.shape.num_experts, dtype=probs.dtype, device=probs.device)
        chosen.index_add_(0, experts.reshape(-1), valid.repeat_interleave(k))
        fraction = chosen / (n * k)
        mean_prob = (probs * valid[:, None]).sum(dim=0) / n
        self.aux.append(self.shape.num_experts * (fraction * mean_prob).sum())
        self.z.append(((torch.logsumexp(logits.float(), dim=-1) ** 2) * valid).sum() / n)
