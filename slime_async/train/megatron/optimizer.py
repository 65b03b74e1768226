"""The optimizer step of the Megatron backend, behind one small interface, on GPU and on CPU.

- `MegatronOptimizer` (GPU): the model is wrapped in Megatron's DDP (contiguous fp32 gradient
  buffers, all-reduce or reduce-scatter over data-parallel ranks); the optimizer is Megatron's
  (`get_megatron_optimizer`: fp32 master weights for bf16 models, the distributed optimizer that
  shards its state over data-parallel ranks when asked).
- `TorchOptimizer` (CPU, CI): torch's AdamW on the parameters themselves, gradients summed over
  data-parallel ranks by hand (an expert's over the ranks holding that expert, and its share of the
  norm from every expert-parallel rank); Megatron's optimizers allocate on "cuda" (see `cpu_compat`).
Both step the same way: gradients of the whole batch are summed (never averaged: the loss shares
already weigh the batch), the global norm is taken over tensor- and pipeline-parallel ranks, a
non-finite loss or norm skips the step leaving weights and optimizer state unchanged, and clipping
scales by min(1, clip / (norm + 1e-6)) as `torch.nn.utils.clip_grad_norm_` does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from slime_async.train.megatron.parallel import Layout


class StepOptimizer(Protocol):
    def zero_grad(self) -> None: ...

    def step(self, loss_finite: bool) -> tuple[bool, float]:
        """Finish gradient reduction, then (when `loss_finite` and the norm is finite) clip and step.
        Returns (applied, grad norm)."""
        ...

    def save(self, directory: Path, layout: Layout) -> None: ...

    def load(self, directory: Path, layout: Layout) -> None: ...


def _state_file(directory: Path, layout: Layout) -> Path:
    return directory / f"optimizer_tp{layout.tp_rank:02d}_pp{layout.pp_rank:02d}_dp{layout.dp_rank:03d}.pt"


class TorchOptimizer:
    """AdamW (torch, the loop implementation as in the torch backend) over a Megatron model's parameters."""

    def __init__(self, model: torch.nn.Module, layout: Layout, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_clip: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # QK-norm weights act on each rank's own heads, and under sequence parallelism (MoE) the norms and
        # routers on each rank's own tokens: their gradients are partial sums over tensor-parallel ranks
        # (Megatron's finalize_model_grads sums them the same way)
        self.tp_summed = [p for n, p in model.named_parameters()
                          if "q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False)]
        # experts' weights differ across expert-parallel ranks (each holds its own experts)
        self.experts = {id(p) for n, p in model.named_parameters() if ".mlp.experts." in n}
        self.layout = layout
        self.grad_clip = grad_clip
        # foreach=False: the same rounding as the torch backend's AdamW, step for step
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           foreach=False)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, loss_finite: bool) -> tuple[bool, float]:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self.params if p.grad is not None]
        if self.layout.tp > 1:
            for p in self.tp_summed:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.layout.tp_group)
        for p in self.params:
            if p.grad is None:
                continue
            if id(p) not in self.experts:
                if self.layout.dp > 1:
                    dist.all_reduce(p.grad, group=self.layout.dp_group)
            elif self.layout.expert_dp > 1:
                dist.all_reduce(p.grad, group=self.layout.expert_dp_group)
        squares = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        expert_squares = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        for p in self.params:
            if p.grad is None:
                continue
            if id(p) in self.experts:  # whole on each rank (expert tensor parallel size 1): no duplicate there
                expert_squares.add_(p.grad.detach().float().pow(2).sum())
            elif param_is_not_tensor_parallel_duplicate(p):
                squares.add_(p.grad.detach().float().pow(2).sum())
        if self.layout.tp * self.layout.pp > 1:
            dist.all_reduce(squares, group=ps.get_model_parallel_group())
        if self.experts and self.layout.ep * self.layout.pp > 1:
            dist.all_reduce(expert_squares, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        squares += expert_squares
        norm = float(squares.sqrt())
        if not (loss_finite and math.isfinite(norm)):
            self.zero_grad()
            return False, norm
        if self.grad_clip > 0:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            for g in grads:
                g.mul_(coef)
        self.optimizer.step()
        return True, norm

    def save(self, directory: Path, layout: Layout) -> None:
        torch.save(self.optimizer.state_dict(), _state_file(directory, layout))

    def load(self, directory: Path, layout: Layout) -> None:
        state = torch.load(_state_file(directory, layout), map_location=layout.device, weights_only=True)
        self.optimizer.load_state_dict(state)


class MegatronOptimizer:
    """Megatron's DDP gradient buffers and optimizer (GPU)."""

    def __init__(self, ddp_model: Any, layout: Layout, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_clip: float, bf16: bool, distributed: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = ddp_model
        self.layout = layout
        self.grad_clip = grad_clip
        self.distributed = distributed
        config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
            adam_eps=eps, clip_grad=grad_clip, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=distributed,
        )
        self.optimizer = get_megatron_optimizer(config, [ddp_model])
        # without Apex or Transformer Engine, Megatron steps torch's Adam over the fp32 master weights
        # in its default (foreach) form: its fused CUDA kernel is one launch per group instead of many
        # (48 of a 711 ms step went to the optimizer, measured; torch's fused AdamW in the plain HF step: 13)
        for inner in self._inner_optimizers():
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, loss_finite: bool) -> tuple[bool, float]:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        # data-parallel reduction, and the tied embedding's gradient across first and last stage
        finalize_model_grads([self.model], num_tokens=None)
        found_inf = self.optimizer.prepare_grads()  # model gradients -> fp32 main gradients
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not (loss_finite and math.isfinite(norm)):
            return False, norm  # nothing stepped; the next zero_grad clears the gradients
        for sub in self.optimizer.chained_optimizers:  # ChainedOptimizer.step, less its own clip
            params = sub.get_parameters()
            if params and self.grad_clip > 0:
                clip_grad_by_total_norm_fp32(params, max_norm=self.grad_clip, total_norm=norm,
                                             use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.optimizer.step_with_ready_grads()
        return True, norm

    def save(self, directory: Path, layout: Layout) -> None:
        state = {"megatron": self.optimizer.state_dict(), "adam_step": self._adam_step()}
        torch.save(state, _state_file(directory, layout))
        if self.distributed:  # the sharded master weights and moments, gathered on data-parallel rank 0
            self.optimizer.save_parameter_state(str(directory / f"param_state_tp{layout.tp_rank:02d}"
                                                                f"_pp{layout.pp_rank:02d}.pt"))

    def load(self, directory: Path, layout: Layout) -> None:
        state = torch.load(_state_file(directory, layout), map_location=layout.device, weights_only=False)
        self.optimizer.load_state_dict(state["megatron"])
        if self.distributed:
            # Without Apex/TE, Megatron falls back to torch's Adam, which keeps a per-parameter "step"
            # that the distributed optimizer's parameter state neither saves nor expects (its loader
            # copies every key of the live state): take it out for the load, put the saved one back.
            for st in self._inner_states():
                st.pop("step", None)
            self.optimizer.load_parameter_state(str(directory / f"param_state_tp{layout.tp_rank:02d}"
                                                                f"_pp{layout.pp_rank:02d}.pt"))
            if state["adam_step"] is not None:
                for inner in self._inner_optimizers():
                    for param, st in inner.state.items():
                        if "exp_avg" in st:  # the fused kernel keeps the step on the parameter's device
                            st["step"] = torch.tensor(float(state["adam_step"]), dtype=torch.float32,
                                                      device=param.device)

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's (chained) optimizer."""
        inner = [getattr(sub, "optimizer", None) for sub in getattr(self.optimizer, "chained_optimizers",
                                                                     [self.optimizer])]
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]

    def _inner_states(self) -> list[dict[str, Any]]:
        """The per-parameter states of the torch optimizers inside Megatron's (chained) optimizer."""
        return [st for inner in self._inner_optimizers() for st in inner.state.values()]

    def _adam_step(self) -> float | None:
        """Adam's step count (every parameter's is the same), when the inner optimizer keeps it per parameter."""
        for st in self._inner_states():
            if "step" in st:
                return float(st["step"])
        return None
