"""A megatron-core `GPTModel` shaped like a Hugging Face Qwen2, Qwen3, Llama or Qwen3-MoE model.

`ModelShape.from_hf` reads the HF config and refuses what the Megatron model would not compute
exactly (sliding windows, YaRN/dynamic RoPE, biases other than Qwen2's QKV bias, ...), naming the
field. `build_gpt_model` makes the model for this process's pipeline stage: RMSNorm, SwiGLU, RoPE
with the config's base and scaling, grouped-query attention, Qwen2's QKV bias, Qwen3's QK-norm,
tied or untied embeddings. RoPE's inverse frequencies are computed by transformers' own function
for the config (default, linear or llama3 scaling) and set on Megatron's rotary embedding, so the
two models rotate by the same angles whatever the scaling parameters.

Qwen3-MoE (`qwen3_moe`; `slime_async.moe.shape.moe_shape` reads and refuses the expert fields):
every layer's MLP is Megatron's `MoELayer` with our `moe_router.QwenRouter` (Qwen3's softmax top-k,
per-token routing replay, our router losses; Megatron's own aux losses are off, see there), the
all-to-all token dispatcher, no token dropping (no capacity factor), router logits in the hidden
dtype then softmax in float32 (as HF), and
experts split over `expert_model_parallel_size` of the tensor x data-parallel ranks. Experts are our
`grouped_experts.GroupedExperts` (`train.megatron.moe_grouped_gemm`, the default: every local expert's
weights stacked, two `torch._grouped_mm` per layer; Megatron's own grouped experts need Transformer
Engine or the `grouped_gemm` package, installed neither here nor on the GPU machine), or Megatron's
`SequentialMLP` (one `MLP` per local expert, `mlp.experts.local_experts.i.linear_fc1/2`, fc1 = [gate;
up] as in the dense MLP, a Python loop over the experts with tokens). Experts are never split by tensor
parallelism (expert tensor parallel size 1: Qwen3-MoE's
experts are small matrices, and whole ones need no collective inside an expert). With tensor
parallelism a MoE model runs Megatron's sequence parallelism, which its MoE layer requires: each
tensor-parallel rank holds a contiguous part of the sequence outside attention and the output layer,
normalises and routes those tokens itself (`SequenceParallelRMSNorm` stands in for Megatron's torch
norm, which refuses sequence parallelism), and the backend pads micro-batches to a multiple of the
tensor-parallel size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from slime_async.moe.shape import MoeShape, moe_shape

AttentionKind = Literal["sdpa", "local", "te"]
SUPPORTED = ("qwen2", "qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """What the conversion and the Megatron model need to know of a HF causal LM."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """Rows of the HF embedding (what engines and exported weights have)."""
    padded_vocab_size: int
    """Rows of the Megatron embedding: `vocab_size` rounded up for tensor parallelism."""
    rms_norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    rope_theta: float
    inv_freq: torch.Tensor = field(repr=False)
    """RoPE inverse frequencies [head_dim / 2], float32, as transformers computes them."""
    moe: MoeShape | None = None
    """The experts of a MoE model; None for a dense one."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: Any, tensor_parallel: int = 1, vocab_multiple: int = 128) -> ModelShape:
        """The shape of a transformers config (Qwen2/Qwen3/Llama), or a ValueError naming what is
        not supported."""
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            raise ValueError(f"model.path: the megatron backend converts {', '.join(SUPPORTED)} models, "
                             f"not model_type {kind!r}")

        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"model.path: config.json {field_name}: {why} (the megatron backend would not "
                              f"compute the same model)")

        if getattr(config, "hidden_act", "silu") != "silu":
            raise bad("hidden_act", f"{config.hidden_act!r} is not supported, only silu (SwiGLU)")
        if getattr(config, "use_sliding_window", False):
            raise bad("use_sliding_window", "sliding-window attention is not supported")
        if kind != "qwen2" and getattr(config, "attention_bias", False):
            raise bad("attention_bias", "biases on q/k/v/o projections are not supported")
        if getattr(config, "mlp_bias", False):
            raise bad("mlp_bias", "MLP biases are not supported")
        if getattr(config, "attention_dropout", 0.0):
            raise bad("attention_dropout", "dropout is not supported")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv:
            raise bad("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta, inv_freq = _rope(config, head_dim, bad)
        moe = moe_shape(config)
        if kind == "qwen3_moe" and moe is None:
            raise bad("num_experts", "a qwen3_moe config without experts is not supported")
        multiple = vocab_multiple * tensor_parallel
        padded = math.ceil(config.vocab_size / multiple) * multiple
        if (padded - config.vocab_size) * tensor_parallel >= padded:
            raise ValueError(f"train.megatron.vocab_multiple: padding {config.vocab_size} rows to {padded} leaves a "
                             f"tensor-parallel rank nothing but padding; use a smaller multiple")
        return cls(
            model_type=kind, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size, padded_vocab_size=padded,
            rms_norm_eps=config.rms_norm_eps, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "qwen3_moe"),
            max_position_embeddings=config.max_position_embeddings, rope_theta=theta, inv_freq=inv_freq, moe=moe,
        )

    def check_parallel(self, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1) -> None:
        """ValueError naming the config field when the sizes cannot split this model."""
        tp, pp, ep = tensor_parallel, pipeline_parallel, expert_parallel
        if self.moe is None and ep > 1:
            raise ValueError(f"train.megatron.expert_parallel: {ep} asks to split experts, but {self.model_type} is "
                             f"a dense model; use 1")
        if self.moe is not None and self.moe.num_experts % ep:
            raise ValueError(f"train.megatron.expert_parallel: {ep} does not divide the {self.moe.num_experts} "
                             f"experts")
        if self.num_heads % tp:
            raise ValueError(f"train.megatron.tensor_parallel: {tp} does not divide the {self.num_heads} "
                             f"attention heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"train.megatron.tensor_parallel: {tp} and the {self.num_kv_heads} key/value heads must "
                             f"divide one another")
        if self.moe is None and self.ffn_hidden_size % tp:  # experts are whole on every rank
            raise ValueError(f"train.megatron.tensor_parallel: {tp} does not divide intermediate_size "
                             f"{self.ffn_hidden_size}")
        if self.num_layers % pp:
            raise ValueError(f"train.megatron.pipeline_parallel: {pp} does not divide the {self.num_layers} layers")


def _rope(config: Any, head_dim: int, bad: Any) -> tuple[float, torch.Tensor]:
    """(theta, inverse frequencies) for the config's RoPE, computed by transformers' own code."""
    params = getattr(config, "rope_parameters", None)  # transformers 5
    if params is None:  # transformers 4: rope_theta and rope_scaling
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise bad("partial_rotary_factor", "partial rotary embeddings are not supported")
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return theta, inv_freq
    if rope_type not in ("linear", "llama3"):
        raise bad("rope_parameters.rope_type", f"{rope_type!r} is not supported (default, linear and llama3 are)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    if attention_scaling != 1.0:
        raise bad("rope_parameters", f"RoPE attention scaling {attention_scaling} is not supported")
    return theta, inv_freq.float().cpu()


def transformer_config(
    shape: ModelShape,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    dtype: torch.dtype,
    on_gpu: bool,
    recompute: bool = False,
    expert_parallel: int = 1,
    wgrad_fusion: bool = False,
) -> Any:  # -> megatron.core.transformer.TransformerConfig
    """Megatron's TransformerConfig for `shape`: no dropout, no biases but Qwen2's QKV bias, fusions
    that need neither Apex nor Transformer Engine on GPU only (`wgrad_fusion` only once
    `wgrad_fusion.enable` said yes); for MoE, the experts and router."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict[str, Any] = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if shape.moe is not None:
        extra.update(
            num_moe_experts=shape.moe.num_experts,
            moe_router_topk=shape.moe.top_k,
            moe_ffn_hidden_size=shape.moe.expert_intermediate_size,
            # Megatron's meaning: top-k of the softmax over all experts, unnormalised (pre) = Qwen's
            # norm_topk_prob False; softmax over the k top logits = renormalised (norm_topk_prob True).
            # QwenRouter computes the weights itself and reads this flag for the renormalisation.
            moe_router_pre_softmax=not shape.moe.norm_topk_prob,
            moe_router_score_function="softmax",
            # moe_router_dtype stays unset: QwenRouter computes the logits in the hidden dtype, as HF does
            moe_expert_capacity_factor=None,  # no token dropping
            # the router losses are QwenRouter's (moe_router.py says why not Megatron's)
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_grouped_gemm=False,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=1,
            # Megatron's MoE layer with tensor parallelism needs it (the module docstring says how it runs)
            sequence_parallel=tensor_parallel > 1,
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # weights are loaded from the HF checkpoint: skip random initialisation
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        # jit-fused SwiGLU and bias-dropout-add are plain torch; RoPE/softmax fusions need TE or Apex
        # (not for experts: Megatron's compiled weighted SwiGLU recompiles for every expert's token count
        # and gives up after 8, measured on an H100)
        bias_activation_fusion=on_gpu and shape.moe is None,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        # weight gradients straight into DDP's float32 buffers (`wgrad_fusion.enable` must have said yes)
        gradient_accumulation_fusion=wgrad_fusion,
        persist_layer_norm=False,
        # the loss shares from the LossFn already weigh the whole batch: sum gradients over
        # micro-batches and data-parallel ranks, never average them
        calculate_per_token_loss=True,
        # micro-batches are trimmed to their longest row: pipeline stages exchange shapes first
        variable_seq_lengths=True,
        # MoE: tokens travel to their experts' ranks by all-to-all; dense models: the default
        # "allgather" refuses the line above
        moe_token_dispatcher_type="alltoall",
        **extra,
    )


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in Megatron's local spec under sequence parallelism (Megatron's `WrappedTorchNorm`
    refuses it). Its weight is flagged `sequence_parallel`: its gradient is a partial sum over this
    rank's tokens (or, in QK-norm, heads), which the optimizer sums over tensor-parallel ranks."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True  # type: ignore[attr-defined]


def layer_spec(shape: ModelShape, attention: AttentionKind, sequence_parallel: bool = False,
               grouped_experts: bool = True) -> Any:  # -> ModuleSpec
    """The transformer layer spec: Transformer Engine's, or Megatron's local one with `attention`
    (`sdpa`: our SDPA core attention; `local`: Megatron's unfused DotProductAttention); for MoE our
    router, and our grouped experts unless `grouped_experts` is False (then Megatron's SequentialMLP)."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = shape.moe.num_experts if shape.moe is not None else None
    if attention == "te":
        if not te_available():
            raise ValueError("train.megatron.attention: te asks for Transformer Engine, which is not installed")
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                        normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    if attention == "sdpa":
        from slime_async.train.megatron.sdpa_attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if sequence_parallel and attention != "te":  # Transformer Engine's norms run it themselves
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
        if shape.qk_norm:
            layer.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
            layer.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
    if experts is not None:
        from slime_async.train.megatron.moe_router import QwenRouter

        set_router(spec.submodules.mlp, QwenRouter)
        if grouped_experts:
            from slime_async.train.megatron.grouped_experts import GroupedExperts

            set_experts(spec.submodules.mlp, GroupedExperts)
    return spec


def _moe_submodules(mlp: Any) -> Any:
    """The MoESubmodules of a MoE layer's spec: a ModuleSpec (megatron-core 0.16, CPU here) or
    `partial(MoELayer, submodules=MoESubmodules(...))` (0.19, the GPU machine's)."""
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def set_router(mlp: Any, router: type) -> None:
    """Set the router class of a MoE layer's spec (either form, `_moe_submodules`)."""
    _moe_submodules(mlp).router = router


def set_experts(mlp: Any, experts: type) -> None:
    """Set the experts class of a MoE layer's spec (either form): Megatron builds it with (local experts,
    config, pg_collection=...) in 0.16 (`build_module` of a class) and 0.19 (a builder callable)."""
    _moe_submodules(mlp).experts = experts


def build_gpt_model(
    shape: ModelShape,
    config: Any,
    attention: AttentionKind,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    device: torch.device | str = "cpu",
    grouped_experts: bool = True,
) -> Any:  # -> megatron.core.models.gpt.GPTModel
    """This stage's GPTModel (uninitialised weights: load them with `convert.load_hf_weights`);
    `grouped_experts`: see `layer_spec`."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(shape, attention, config.sequence_parallel, grouped_experts)
    if config.sequence_parallel and attention != "te":  # the final norm too (Megatron's default refuses it)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                          layer_norm=SequenceParallelRMSNorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay split over the vocabulary (logprobs.py reduces them)
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rotary_percent=1.0,
    )
    if post_process and not config.sequence_parallel:  # under it the layer gathers its input's sequence
        _logits_batch_first(model.output_layer)
    # transformers' frequencies (any supported scaling) instead of Megatron's own computation; a plain
    # attribute, so float32 whatever the parameters' dtype
    model.rotary_pos_emb.inv_freq = shape.inv_freq.to(device)
    # every parameter in the config's dtype, as Megatron's Float16Module would make them: the local spec's
    # torch norms are created in float32 (a bf16 model would then mix dtypes)
    return model.to(device=device, dtype=config.params_dtype)


def _logits_batch_first(layer: torch.nn.Module) -> None:
    """Make Megatron's output layer (a `ColumnParallelLinear`; left as it is if another class)
    compute the logits batch-first, in place."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if type(layer) is ColumnParallelLinear:
        layer.__class__ = _batch_first_output_layer()


@functools.cache
def _batch_first_output_layer() -> type:
    """Megatron's output layer computing the logits batch-first.

    GPTModel's last step turns the output layer's [s, b, V] logits into [b, s, V] with
    `transpose(0, 1).contiguous()`: a strided copy of the whole logits forward, and another of their
    gradient backward (2.5 GB each per micro-batch of 2 x 4096 tokens at a 152k vocabulary; 43 ms of a
    580 ms train step on the H200, the largest kernel after the matmuls, and gone from the profile with
    this layer). This layer transposes its
    small input instead ([s, b, hidden]: 1/74 of the logits there) and returns its [b, s, V] result as a
    [s, b, V] view, so GPTModel's transpose gives back the contiguous tensor and `contiguous()` copies
    nothing. Same parameters, names and arithmetic (each logit is the same dot product)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class BatchFirstOutputLayer(ColumnParallelLinear):
        def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
            logits, bias = super().forward(input_.transpose(0, 1).contiguous(), weight, runtime_gather_output)
            return logits.transpose(0, 1), bias

    return BatchFirstOutputLayer
