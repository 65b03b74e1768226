"""What each part of a run holds in GPU memory, from the config and the model's shape, before anything starts.

On one GPU the trainer and the engines share its memory, and neither gives memory back while the other
runs (`sync.release_memory` off, the default when both fit). What each part holds:

- trainer, fixed: per parameter, its weights, gradients and AdamW's two moments. The megatron backend
  keeps the weights in `model.dtype`, the gradients in a float32 buffer (`main_grad`) and, in bfloat16,
  float32 master weights: 18 bytes a parameter in bfloat16, 16 in float32. The torch backend keeps
  parameters, gradients and moments in float32 whatever `model.dtype` (autocast): 16 bytes. LoRA trains
  the adapters alone (the base keeps its weights only); a KL term (`train.kl_coef`) keeps a frozen
  reference copy. Tensor and pipeline parallelism split all of it over their ranks (one GPU each).
- trainer, per token of a micro-batch (an estimate, not exact): the logits and their gradient (2 x the
  vocabulary in `model.dtype`) and, per layer, the inputs backward needs (layer norms, q/k/v, attention
  output, the MLP's input, gate/up and product: `7h + q + 2kv + 3i` values, `i` the MLP width a token
  uses, its experts' in an MoE); with `train.megatron.recompute_activations`, one layer input per layer.
  A micro-batch is at most `train.micro_batch_size x train.max_seq_len` tokens (padded to its longest
  row), usually far fewer.
- embedded engine: its weights in `model.dtype` and its KV cache, `engine.max_batch_size` slots times
  the longest sequence in them: the cache grows on demand, so its ceiling here is at
  `train.max_seq_len` (a longer sequence is not trained whole) and never past the model's context.
- SGLang and vLLM servers take the fraction of the GPU their arguments give (`mem_fraction_static`,
  `gpu_memory_utilization`; vLLM's default 0.9; SGLang chooses its own when unset).
- the warm-start runs before the parts start, alone on the GPU, and gives its memory back: it is
  shown, not added. Engines under `sync.release_memory` give theirs back while the trainer computes:
  they count against the fixed parts (the trainer's state stays while they generate), not against
  the room for a micro-batch.

Check: `fixed` adds up the fixed parts exactly as listed (the tests compare the trainer's to the bytes
a real backend allocates); a run is refused before it starts only when the fixed parts alone exceed
the GPU, the one case where running out of memory is certain.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_async.config import Config, ConfigError

GB = 1e9
VLLM_DEFAULT_FRACTION = 0.9
"""vLLM's `gpu_memory_utilization` when the config sets none."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its parameters and the widths its tokens pass through."""

    parameters: int
    layers: int
    hidden: int
    vocab: int
    q_width: int
    """Query heads x head size."""
    kv_width: int
    """Key-value heads x head size (one of K or V)."""
    mlp_width: int
    """The MLP width one token uses: the dense intermediate size, or top-k x an expert's."""
    context: int
    """Positions the model takes (`max_position_embeddings`): the engine's context."""
    tied: bool = True
    """The output layer shares the embedding's weights (`tie_word_embeddings`)."""
    lora_targets: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Linear layers by their last name: (count, in + out features summed over them), for LoRA's adapters."""

    def lora_parameters(self, rank: int, targets: list[str]) -> int:
        return sum(rank * width for name, (_, width) in self.lora_targets.items() if name in targets)


def model_shape(config: Any) -> ModelShape:
    """The shape of a transformers config (`AutoConfig`): parameters counted on a model built on the
    meta device (no memory, any architecture transformers knows), widths from the config."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            last = name.rsplit(".", 1)[-1]
            count, width = targets.get(last, (0, 0))
            targets[last] = (count + 1, width + module.in_features + module.out_features)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    experts = int(getattr(config, "num_experts", 0) or 0)
    mlp = int(config.num_experts_per_tok) * int(config.moe_intermediate_size) if experts \
        else int(config.intermediate_size)
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()), layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size), vocab=int(config.vocab_size), q_width=heads * head_dim,
        kv_width=int(getattr(config, "num_key_value_heads", None) or heads) * head_dim, mlp_width=mlp,
        context=int(config.max_position_embeddings), tied=bool(getattr(config, "tie_word_embeddings", False)),
        lora_targets=targets)


def model_shape_of(model_dir: str | Path) -> ModelShape:
    from transformers import AutoConfig

    return model_shape(AutoConfig.from_pretrained(str(model_dir)))


@dataclass
class Share:
    """One part's memory on the GPU: fixed items, and what grows (per token, or up to a ceiling)."""

    part: str
    fixed: dict[str, float] = field(default_factory=dict)
    """Item -> bytes, held for the whole run."""
    per_token: dict[str, float] = field(default_factory=dict)
    """Item -> bytes per token of a micro-batch (the trainer's activations; an estimate)."""
    up_to: dict[str, float] = field(default_factory=dict)
    """Item -> bytes it may grow to (the engine's cache)."""
    alone: bool = False
    """Runs before the others and gives its memory back (the warm-start): not added to the total."""
    released: bool = False
    """Gives its memory back while the trainer computes (an engine under `sync.release_memory`)."""

    @property
    def held(self) -> float:
        return sum(self.fixed.values()) + sum(self.up_to.values())


@dataclass
class Plan:
    shares: list[Share]
    gpu_bytes: float
    micro_batch_tokens: int
    """The largest micro-batch the config allows: `train.micro_batch_size x train.max_seq_len`."""

    @property
    def fixed(self) -> float:
        """What the parts that run together hold before any micro-batch: fixed items and ceilings."""
        return sum(s.held for s in self.shares if not s.alone)

    @property
    def per_token(self) -> float:
        return sum(sum(s.per_token.values()) for s in self.shares if not s.alone)

    @property
    def fits(self) -> bool:
        """Whether the fixed parts fit at all (a micro-batch too long may still not)."""
        return self.fixed <= self.gpu_bytes

    def summary(self, per_token: bool = True) -> str:
        """Each part that runs with the others, in one line: what it holds (and per micro-batch token)."""
        return ", ".join(f"{s.part} {s.held / GB:.1f} GB" + (f" + {sum(s.per_token.values()) / 1e6:.2f} MB a "
                                                            "micro-batch token" if per_token and s.per_token else "")
                         for s in self.shares if not s.alone)

    @property
    def tokens_that_fit(self) -> int:
        """Tokens of a micro-batch that fit beside the parts that stay while the trainer computes (0 when
        the fixed parts alone do not fit)."""
        if not self.fits:
            return 0
        room = self.gpu_bytes - sum(s.held for s in self.shares if not (s.alone or s.released))
        return max(0, int(room // self.per_token)) if self.per_token else 0

    def verdict(self) -> str:
        """One line: whether the run fits on this GPU, and what to change when it does not."""
        gpu, fixed = self.gpu_bytes / GB, self.fixed / GB
        if not self.fits:
            return (f"does not fit: the parts' fixed memory alone is {fixed:.1f} GB of the GPU's {gpu:.1f} GB; "
                    "split the trainer over more GPUs (train.megatron.tensor_parallel), train adapters "
                    "(train.lora), or give the engine fewer slots (engine.max_batch_size)")
        fits = self.tokens_that_fit
        if fits >= self.micro_batch_tokens:
            return (f"fits: {fixed:.1f} GB fixed of {gpu:.1f} GB leaves room for {fits:,} tokens a micro-batch, "
                    f"more than the config's largest ({self.micro_batch_tokens:,})")
        return (f"fits while a micro-batch stays under about {fits:,} tokens ({fixed:.1f} GB fixed of {gpu:.1f} GB, "
                f"{self.per_token / 1e6:.2f} MB a token); the config allows up to {self.micro_batch_tokens:,} "
                "(train.micro_batch_size x train.max_seq_len), and a padded micro-batch of long rows past that "
                "runs out of memory: lower train.micro_batch_size")


def trainer_share(cfg: Config, shape: ModelShape) -> Share:
    t = cfg.train
    bf16 = cfg.model.dtype == "bfloat16"
    megatron = t.backend == "megatron"
    weight = (2 if bf16 else 4) if megatron else 4  # the torch backend keeps float32 parameters (autocast)
    state = (4 + 4 + 8 if bf16 else 4 + 8) if megatron else 4 + 8  # gradients, master copy, AdamW moments
    split = t.megatron.tensor_parallel * t.megatron.pipeline_parallel if megatron else 1
    parameters = shape.parameters
    if megatron:  # Megatron pads the vocabulary to a multiple of train.megatron.vocab_multiple x tensor_parallel
        multiple = t.megatron.vocab_multiple * t.megatron.tensor_parallel
        parameters += (-shape.vocab % multiple) * shape.hidden * (1 if shape.tied else 2)
    trained = shape.lora_parameters(t.lora.rank, t.lora.target_modules) if t.lora else parameters
    share = Share("trainer")
    share.fixed["weights"] = parameters * weight / split
    if t.lora:
        share.fixed["LoRA adapters"] = trained * weight / split
    share.fixed["gradients, master weights, AdamW state" if megatron and bf16 else "gradients, AdamW state"] = \
        trained * state / split
    if t.kl_coef > 0:
        share.fixed["reference weights (train.kl_coef)"] = parameters * weight / split
    act = 2 if bf16 else 4
    layer = shape.hidden if megatron and t.megatron.recompute_activations else \
        7 * shape.hidden + shape.q_width + 2 * shape.kv_width + 3 * shape.mlp_width
    share.per_token["activations (estimate)"] = shape.layers * layer * act / split
    share.per_token["logits and their gradient"] = 2 * shape.vocab * act / (t.megatron.tensor_parallel if megatron
                                                                            else 1)
    return share


def engine_share(cfg: Config, shape: ModelShape, name: str = "engine") -> Share:
    """One embedded engine on `shape` (the policy's, or a distillation teacher's)."""
    dtype = 2 if cfg.model.dtype == "bfloat16" else 4
    positions = min(shape.context, cfg.train.max_seq_len)
    return Share(name, fixed={"weights": shape.parameters * dtype},
                 up_to={f"KV cache ({cfg.engine.max_batch_size} slots x {positions:,} positions)":
                        cfg.engine.max_batch_size * positions * shape.layers * 2 * shape.kv_width * dtype})


def server_share(cfg: Config, gpu_bytes: float) -> Share | None:
    """A launched SGLang or vLLM server: the fraction of the GPU its arguments give; None where unknown."""
    if cfg.engine.kind == "vllm":
        fraction = float(cfg.vllm.args.get("gpu_memory_utilization", VLLM_DEFAULT_FRACTION))
        return Share("engine (vLLM)", fixed={f"gpu_memory_utilization {fraction}": fraction * gpu_bytes})
    fraction = getattr(cfg.sglang, "mem_fraction_static", None)  # a field of SGLang's own (config.sglang)
    if fraction is None:
        return None
    return Share("engine (SGLang)", fixed={f"mem_fraction_static {fraction}": float(fraction) * gpu_bytes})


def plan(cfg: Config, shape: ModelShape, gpu_bytes: float, teacher: ModelShape | None = None) -> Plan:
    """The parts of `cfg` that run on one GPU of `gpu_bytes`: the trainer, the engines this run starts
    (not those it attaches to), a distillation teacher's engine, and the warm-start before them."""
    shares = [trainer_share(cfg, shape)]
    if not cfg.engine.urls:
        if cfg.engine.kind == "embedded":
            shares += [engine_share(cfg, shape, "engine" if cfg.engine.num_engines == 1 else f"engine {i}")
                       for i in range(cfg.engine.num_engines)]
        else:
            server = server_share(cfg, gpu_bytes)
            shares += [server] * cfg.engine.num_engines if server is not None else []
    for s in shares[1:]:
        s.released = bool(cfg.sync.release_memory)
    if teacher is not None and not cfg.train.distill.urls:
        shares.append(engine_share(cfg, teacher, "teacher engine (train.distill)"))
    if cfg.warmstart.enabled:
        shares.append(Share("warm-start (before the run, then given back)", alone=True,
                            fixed={"weights, gradients, AdamW state": shape.parameters * 16}))
    return Plan(shares, gpu_bytes, cfg.train.micro_batch_size * cfg.train.max_seq_len)


def rows(p: Plan) -> list[tuple[str, str, str]]:
    """(part, item, amount) rows of a plan, for a table."""
    out = []
    for s in p.shares:
        for item, b in s.fixed.items():
            out.append((s.part, item, f"{b / GB:.2f} GB"))
        for item, b in s.up_to.items():
            out.append((s.part, item, f"up to {b / GB:.2f} GB"))
        for item, b in s.per_token.items():
            out.append((s.part, item, f"{b / 1e6:.3f} MB a token of a micro-batch"))
    return out


def gpu_total_bytes() -> float | None:
    """The first visible GPU's memory, asked of `nvidia-smi` (None without one): not of torch, which would
    make this process hold a CUDA context for the whole run."""
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "-i", device, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return float(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else None  # MiB
    except (IndexError, ValueError):
        return None


def plan_for(cfg: Config, gpu_bytes: float) -> Plan:
    """`plan` of a config, its model (and a distillation teacher's) read from their directories."""
    from slime_async.config.model_dir import resolve_model_path

    shape = model_shape_of(resolve_model_path(cfg.model.path))
    teacher = model_shape_of(resolve_model_path(cfg.train.distill.model, "train.distill.model")) \
        if cfg.train.distill.model else None
    return plan(cfg, shape, gpu_bytes, teacher)


def check_fits(p: Plan) -> None:
    """Refuse a run whose fixed parts alone exceed the GPU: it would run out of memory for certain, after
    minutes of starting (and of a warm-start)."""
    if not p.fits:
        raise ConfigError(f"GPU memory: {p.verdict()} ({p.summary(per_token=False)})")
