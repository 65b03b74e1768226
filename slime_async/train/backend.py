"""The narrow interface every trainer backend (`torch`, later `megatron`) implements.

The loop and the objective speak only to this. A backend owns the model, the optimizer and the
device; it knows nothing of losses (it calls the `LossFn` it is given per micro-batch), of engines
or of versions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from slime_async.train.batch import Batch


@dataclass
class Logprobs:
    """Per-token outputs of a forward pass, aligned with the batch's tokens ([N, T], CPU, float32)."""

    logprobs: torch.Tensor
    """log p(token t | tokens before t) at the given temperature; 0 at t = 0 and on padding."""
    entropy: torch.Tensor | None = None
    """Entropy of the distribution that predicted token t (when asked for)."""


LossFn = Callable[[Batch, slice, Logprobs], tuple[torch.Tensor, dict[str, float | torch.Tensor]]]
"""(loss, metrics) of one micro-batch; a metric may be a 0-d tensor on the device (summed over the
micro-batches there, and read once at the step's end: `metric_floats`)."""


def metric_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's summed metrics as floats (one read of the device for the lot)."""
    return {k: float(v) for k, v in metrics.items()}
"""Called once per micro-batch with its rows (a `Batch`), their place in the whole batch and the
current policy's outputs (with gradient, on the backend's device). Returns the micro-batch's share
of the batch loss (already weighted over the whole batch: shares add up) and metrics to sum."""


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW as both backends run it, from `train.lr`, `adam_betas`, `adam_eps`, `weight_decay` and
    `grad_clip` (`from_config`): one place, so a setting added for one backend reaches the other."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0: no clipping."""

    @classmethod
    def from_config(cls, train: Any) -> OptimizerSettings:
        """From the config's `train` section (`config.schema.TrainConfig`)."""
        return cls(lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps,  # type: ignore[arg-type]
                   weight_decay=train.weight_decay, grad_clip=train.grad_clip)


DEFAULT_OPTIMIZER = OptimizerSettings()


@dataclass
class StepResult:
    applied: bool
    """False when the step was skipped (non-finite loss or grad norm): weights and optimizer unchanged."""
    loss: float
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    """Why the step was skipped, for people."""


class TrainerBackend(Protocol):
    """What the loop needs from a backend. Weights go out in Hugging Face naming."""

    def logprobs(self, batch: Batch, temperature: float, entropy: bool = False, reference: bool = False
                 ) -> Logprobs:
        """Per-token logprobs of `batch` without gradient, micro-batched; `reference` uses the frozen
        initial model (KL penalties)."""
        ...

    def train_step(self, batch: Batch, loss_fn: LossFn, temperature: float, entropy: bool = False) -> StepResult:
        """Forward/backward over micro-batches (gradients accumulate), clip, one optimizer step."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter once (tied ones under their first name), HF names, on the backend's device."""
        ...

    def save(self, path: Path) -> None:
        """Model (as a HF directory: loadable by engines) and optimizer state into `path`."""
        ...

    def load(self, path: Path) -> None:
        """The inverse of `save`."""
        ...
