"""The expert layout of a Hugging Face mixture-of-experts config, or a clear refusal.

Supported: Qwen3-MoE's router (`qwen3_moe`): a linear gate, softmax over all experts, top-k, the
k weights renormalised to sum to 1 when `norm_topk_prob` (else left as they are), no shared
experts, every decoder layer sparse. Anything else that changes the computation is refused with the
config field that asks for it, so no part ever runs a model other than the one in the checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Config fields of other MoE families that change the router or add parts we do not compute, with why.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    # field: (the value that is harmless, why anything else is refused)
    "n_group": ((None, 0, 1), "grouped top-k routing (DeepSeek's group-limited routing) is not supported"),
    "topk_group": ((None, 0, 1), "grouped top-k routing (DeepSeek's group-limited routing) is not supported"),
    "n_shared_experts": ((None, 0), "shared experts are not supported"),
    "shared_expert_intermediate_size": ((None, 0), "shared experts are not supported"),
    "routed_scaling_factor": ((None, 1, 1.0), "scaled routing weights are not supported"),
    "first_k_dense_replace": ((None, 0), "dense layers among the MoE layers are not supported"),
    "moe_layer_freq": ((None, 1), "dense layers among the MoE layers are not supported"),
}
_SCORING = ("scoring_func", ("softmax",))
_TOPK_METHOD = ("topk_method", ("greedy",))
MOE_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class MoeShape:
    """Experts of a MoE model: the same in the engine, the torch backend and Megatron."""

    num_experts: int
    top_k: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    expert_intermediate_size: int
    """Rows of each expert's gate and up projections (`moe_intermediate_size`)."""
    norm_topk_prob: bool
    """Renormalise the top-k softmax weights to sum to 1."""
    num_layers: int
    """Decoder layers; every one is sparse."""
    router_aux_loss_coef: float
    """The checkpoint's load-balancing loss weight (`router_aux_loss_coef`)."""

    @property
    def route_width(self) -> int:
        """Expert ids recorded per token: one per layer and top-k slot."""
        return self.num_layers * self.top_k


def is_moe(config: Any) -> bool:
    """Does this HF config describe a mixture-of-experts model (of any family)?"""
    return any(int(getattr(config, f, 0) or 0) > 0 for f in ("num_experts", "n_routed_experts", "num_local_experts"))


def moe_shape(config: Any, field: str = "model.path") -> MoeShape | None:
    """The `MoeShape` of a HF config, None for a dense model, or a ValueError naming the config field
    that asks for something no part computes."""
    if not is_moe(config):
        return None
    kind = getattr(config, "model_type", None)

    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{field}: config.json {name}: {why} (supported MoE: {', '.join(MOE_TYPES)}-style routing)")

    for name, (ok, why) in _UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value not in ok:
            raise bad(name, f"{value!r}: {why}")
    for name, ok in (_SCORING, _TOPK_METHOD):
        value = getattr(config, name, None)
        if value is not None and value not in ok:
            raise bad(name, f"{value!r} is not supported (only {ok[0]!r})")
    if kind not in MOE_TYPES:
        raise ValueError(f"{field}: model_type {kind!r} is a mixture-of-experts model this project does not "
                         f"convert; supported: {', '.join(MOE_TYPES)}")
    layers = int(config.num_hidden_layers)
    if list(getattr(config, "mlp_only_layers", None) or []):
        raise bad("mlp_only_layers", f"{config.mlp_only_layers}: dense layers among the MoE layers are not supported")
    if int(getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise bad("decoder_sparse_step", f"{config.decoder_sparse_step}: every layer must be sparse (1)")
    experts, top_k = int(config.num_experts), int(config.num_experts_per_tok)
    if not 0 < top_k <= experts:
        raise bad("num_experts_per_tok", f"{top_k} must be between 1 and num_experts ({experts})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise bad("hidden_act", f"{config.hidden_act!r} is not supported, only silu (SwiGLU experts)")
    return MoeShape(
        num_experts=experts, top_k=top_k, expert_intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)), num_layers=layers,
        router_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def replay_shape(model_dir: str | Path, routing_replay: bool, engine: str | None) -> MoeShape | None:
    """The MoE shape whose routing a rollout should record (`train.moe.routing_replay`), or None: a
    dense model, replay off, or engines that cannot report routing (`engine` names them, as in
    "vLLM", None when they can; said once, in the log)."""
    if not routing_replay:
        return None
    from transformers import AutoConfig

    shape = moe_shape(AutoConfig.from_pretrained(str(model_dir)))
    if shape is not None and engine is not None:
        log.warning("train.moe.routing_replay: %s engines do not report routed experts; training without replay",
                    engine)
        return None
    return shape
