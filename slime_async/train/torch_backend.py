"""The `torch` backend: a transformers model on CPU or one GPU, AdamW, gradient accumulation.

Sequences are right-padded per micro-batch (trimmed to the micro-batch's longest row), with an
attention mask; causal attention means padding after a token never changes that token's logits.
`bfloat16` is mixed precision: parameters and AdamW state stay float32 (bf16 master weights lose
small updates), forward and backward run under bf16 autocast, and weights are exported in bf16
(the engines' dtype; half the bytes to publish).
Logprobs are computed in float32 from the logits whatever the model's dtype, as the engine's
sampler does (`engine.sampling`: log_softmax(logits / temperature)).
Qwen3-MoE experts run transformers' own `grouped_mm` implementation (its default where
`torch._grouped_mm` can run: tokens sorted by expert, two grouped matmuls per layer, no loop over
experts; `eager`, its loop, otherwise), the computation of `moe.experts`.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM

from slime_async.config.schema import LoraConfig, MoeConfig
from slime_async.moe.hf_layout import checkpoint_views
from slime_async.moe.shape import moe_shape
from slime_async.train import lora as L
from slime_async.train.backend import DEFAULT_OPTIMIZER, Logprobs, LossFn, OptimizerSettings, StepResult, metric_floats
from slime_async.train.batch import Batch
from slime_async.train.fused_logprobs import fused_logprobs
from slime_async.train.losses import entropy_from_logits
from slime_async.train.moe_router import RouterControl, RouterStats

OPTIMIZER_FILE = "optimizer.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
"""Copied from the model directory into every saved one: a checkpoint's `model/` is then a whole
model directory, usable as `model.path` (`slime-async rollout` on a checkpoint, a new run from it)."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device: cuda was asked for but no GPU is visible; use cpu or auto")
    return torch.device(device)


class TorchBackend:
    """One transformers causal LM with AdamW. Not thread-safe: the loop calls it from one thread at a time."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: Literal["float32", "bfloat16"] = "float32",
        optim: OptimizerSettings = DEFAULT_OPTIMIZER,
        micro_batch_size: int = 16,
        reference: bool = False,
        warmup_steps: int = 0,
        moe: MoeConfig | None = None,
        lora: LoraConfig | None = None,
        publish_adapters: bool = False,
    ) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = resolve_device(device)
        if dtype == "bfloat16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("model.dtype: bfloat16 is not supported by this GPU; use float32")
        self.dtype = torch.float32  # parameters and optimizer state
        self.export_dtype = getattr(torch, dtype)
        self.autocast = dtype == "bfloat16"
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype)
            self.model_dir = Path(model_path)
        except OSError as exc:
            raise ValueError(f"model.path: cannot load a transformers model from {model_path}: {exc}") from None
        self.model = model.to(self.device).train()
        # The frozen initial policy, only when a KL penalty needs it.
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if reference else None
        # MoE: our routers (replay, losses) on the policy only; the reference routes itself
        self.moe_shape = moe_shape(self.model.config)
        self.routers = RouterControl(self.model, self.moe_shape) if self.moe_shape else None
        moe = moe or MoeConfig()
        self.aux_loss_coef = 0.0 if self.moe_shape is None else (
            moe.aux_loss_coef if moe.aux_loss_coef is not None else self.moe_shape.router_aux_loss_coef)
        self.z_loss_coef = moe.z_loss_coef
        self.route_width = self.moe_shape.route_width if self.moe_shape and moe.routing_replay else None
        """Ids per token of a routed-experts record the batches should carry (None: no replay)."""
        self.router_stats = RouterStats(None, None, None, None)
        # LoRA: adapters on the targeted layers, everything else frozen (the reference above, when
        # there is one, is the base model: the adapters start at B = 0, so it is the initial policy)
        self.lora = lora
        self.lora_layers = L.apply_lora(self.model, lora.rank, lora.alpha, lora.target_modules) if lora else {}
        self.publish_adapters = publish_adapters and bool(self.lora_layers)
        """The engines load adapters (vLLM): `named_weights` gives the adapters, not merged weights."""
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        # on a GPU: the token logprobs as compiled kernels over the (bf16) logits, no float32 copy kept
        # (`train/fused_logprobs.py`; Inductor's CPU path would need a C++ compiler)
        self.fused_logprobs = self.device.type == "cuda"
        self.grad_clip = optim.grad_clip
        self.micro_batch_size = micro_batch_size
        self.lr = optim.lr
        self.warmup_steps = warmup_steps
        # fused/foreach kernels differ in rounding from the loop; fixing the implementation keeps
        # runs bit-reproducible on the same machine (checkpoint/resume equivalence relies on it).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
            foreach=False)

    # --- forward --------------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, mb: Batch, temperature: float, entropy: bool,
                 router_losses: bool = False) -> Logprobs:
        ids = mb.input_ids.to(self.device)
        attn = mb.attention_mask.to(self.device)
        if self.routers is not None and model is self.model:
            replay = mb.routed_experts if self.route_width else None
            self.routers.begin(None if replay is None else replay.to(self.device), attn if router_losses else None)
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        finally:
            if self.routers is not None and model is self.model:
                self.router_stats = self.routers.end()
        zero = torch.zeros(ids.shape[0], 1, device=self.device)
        if self.fused_logprobs and not entropy and logits.is_contiguous():
            # the whole logits (no copy): the last position predicts nothing and is dropped after
            targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
            logp = fused_logprobs(logits, targets, temperature, logits.shape[-1])[:, :-1]
            return Logprobs(torch.cat([zero, logp], dim=1) * attn, None)
        logits = logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        # shift so that entry t belongs to token t; padding gets 0
        out = torch.cat([zero, logp], dim=1) * attn
        ent = torch.cat([zero, entropy_from_logits(logits)], dim=1) * attn if entropy else None
        return Logprobs(out, ent)

    def _micro_batches(self, batch: Batch) -> Iterator[tuple[slice, Batch]]:
        for start in range(0, len(batch), self.micro_batch_size):
            stop = min(start + self.micro_batch_size, len(batch))
            yield slice(start, stop), batch.rows(start, stop)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float, entropy: bool = False, reference: bool = False
                 ) -> Logprobs:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
        model = self.model
        if reference:
            if self.reference is None:
                raise ValueError("reference logprobs asked for, but the backend was built without a reference")
            model = self.reference
        n, t = batch.input_ids.shape
        logp = torch.zeros(n, t)
        ent = torch.zeros(n, t) if entropy else None
        for rows, mb in self._micro_batches(batch):
            out = self._forward(model, mb, temperature, entropy)
            k = mb.input_ids.shape[1]
            logp[rows, :k] = out.logprobs.cpu()
            if ent is not None and out.entropy is not None:
                ent[rows, :k] = out.entropy.cpu()
        return Logprobs(logp, ent)

    # --- training -------------------------------------------------------------------------

    def train_step(self, batch: Batch, loss_fn: LossFn, temperature: float, entropy: bool = False) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        summed = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, Any] = {}
        collect = self.routers is not None
        for rows, mb in self._micro_batches(batch):
            out = self._forward(self.model, mb, temperature, entropy, router_losses=collect)
            loss, mb_metrics = loss_fn(mb, rows, out)
            if collect:
                loss = loss + self._router_term(mb, batch, sums)
            loss.backward()
            summed += loss.detach()  # on the device: no host sync per micro-batch
            for k, v in mb_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        total, metrics = float(summed), metric_floats(sums)
        if "moe/replayed_recorded" in metrics:  # share of replayed (token, layer) routes that changed experts
            differ, recorded = metrics.pop("moe/replayed_differ"), metrics.pop("moe/replayed_recorded")
            metrics["moe/route_mismatch"] = differ / recorded if recorded else 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        if not (math.isfinite(total) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(False, total, grad_norm, metrics,
                              reason=f"non-finite {'loss' if not math.isfinite(total) else 'grad norm'}")
        if self.warmup_steps:
            # Adam's first updates move every weight by about lr whatever the gradient's size; a
            # linear ramp keeps them from wrecking a small or freshly warm-started model
            factor = min(1.0, (self.optimizer_steps() + 1) / self.warmup_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * factor
        self.optimizer.step()
        return StepResult(True, total, grad_norm, metrics)

    def _router_term(self, mb: Batch, batch: Batch, sums: dict[str, Any]) -> torch.Tensor:
        """This micro-batch's share of the router losses (weighted by its share of the batch's real
        tokens, as the loss shares weigh the policy loss); their per-layer means go to `sums`."""
        stats = self.router_stats
        aux, z = stats.aux, stats.z
        assert aux is not None and z is not None and self.moe_shape is not None
        share = mb.num_tokens / max(batch.num_tokens, 1)
        layers = self.moe_shape.num_layers
        sums["moe/aux_loss"] = sums.get("moe/aux_loss", 0.0) + share * aux.detach() / layers
        sums["moe/z_loss"] = sums.get("moe/z_loss", 0.0) + share * z.detach() / layers
        if stats.differ is not None and stats.recorded is not None:
            # summed, then divided once at the step's end (`train_step`)
            sums["moe/replayed_differ"] = sums.get("moe/replayed_differ", 0) + stats.differ
            sums["moe/replayed_recorded"] = sums.get("moe/replayed_recorded", 0) + stats.recorded
        return share * (self.aux_loss_coef * aux + self.z_loss_coef * z)

    def optimizer_steps(self) -> int:
        """Optimizer steps taken (AdamW keeps the count per parameter; a loaded state keeps it too)."""
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0

    # --- weights and state ----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.publish_adapters:  # the adapters themselves, under peft's names (`sync.adapters`)
            for name, tensor in L.adapter_tensors(self.lora_layers):
                yield name, tensor.to(self.export_dtype)
            return
        if self.lora_layers:  # only the adapted layers change: their merged weights, under the base names
            for name, weight in L.merged_weights(self.lora_layers):
                yield name, weight.to(self.export_dtype)
            return
        # checkpoint names: an MoE model's fused experts go out one expert at a time (`moe.hf_layout`)
        for name, view in checkpoint_views(self.model).items():
            yield name, view.to(self.export_dtype)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:  # the adapters alone (peft's format); the base is `model.path`
            L.save_adapters(self.lora_layers, path, str(self.model_dir), self.lora.target_modules)
            torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
            return
        self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, path / name)
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        if self.reference is not None:
            self.reference.save_pretrained(path / "reference")

    def load(self, path: Path) -> None:
        if self.lora is not None:
            L.load_adapters(self.lora_layers, path)
        else:
            L.refuse_adapters(path)
            loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
            self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device,
                                                  weights_only=True))
        if self.reference is not None and (path / "reference").is_dir():
            ref = AutoModelForCausalLM.from_pretrained(str(path / "reference"), dtype=self.dtype)
            self.reference.load_state_dict(ref.state_dict())
