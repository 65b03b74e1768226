"""Pipeline parallelism (GPU): this rank's micro-batches through Megatron's pipeline schedule.

The schedule sends activations between stages; the last stage turns logits into logprobs and calls
the `LossFn`. Losses are returned in the schedule's "per-token" form (loss, tokens = 1, extras), which leaves
them unscaled: the shares from the `LossFn` already weigh the whole batch. The backend's
`calculate_per_token_loss` config also keeps DDP from averaging over data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from slime_async.train.backend import Logprobs, LossFn
from slime_async.train.batch import Batch


class PipelinedBackend(Protocol):
    """What the schedule needs of `backend.MegatronBackend` (which calls in here): named as a
    protocol so that this module does not import the backend back."""

    device: torch.device
    micro_batch_size: int
    model: torch.nn.Module

    def _my_micro_batches(self, batch: Batch) -> list[tuple[slice, Batch]]: ...

    def _run_model(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor: ...

    def _logprobs_of(self, logits: torch.Tensor, mb: Batch, temperature: float, entropy: bool) -> Logprobs: ...


def _run(backend: PipelinedBackend, model: torch.nn.Module, batch: Batch, post: Any, forward_only: bool
         ) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = backend._my_micro_batches(batch)
    if not mbs:
        return []
    data = iter(mbs)

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        rows, mb = next(data_iterator)
        output = backend._run_model(chunk, mb)
        return output, lambda out: post(rows, mb, out)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=len(mbs),
        seq_length=int(batch.input_ids.shape[1]), micro_batch_size=backend.micro_batch_size,
        forward_only=forward_only)


def pipeline_logprobs(backend: PipelinedBackend, model: torch.nn.Module, batch: Batch, temperature: float,
                      logp: torch.Tensor, ent: torch.Tensor | None) -> None:
    """Fill this rank's rows of `logp` (and `ent`) on the last stage."""
    zero = torch.zeros((), device=backend.device)
    one = torch.ones((), dtype=torch.int, device=backend.device)

    def post(rows: slice, mb: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        out = backend._logprobs_of(logits, mb, temperature, ent is not None)
        return zero, one, {"rows": rows, "logp": out.logprobs, "ent": out.entropy}

    for item in _run(backend, model, batch, post, forward_only=True):
        if item["rows"].start == item["rows"].stop:  # a filler micro-batch (expert parallelism)
            continue
        k = item["logp"].shape[1]
        logp[item["rows"], :k] = item["logp"]
        if ent is not None:
            ent[item["rows"], :k] = item["ent"]


def pipeline_train(backend: PipelinedBackend, batch: Batch, loss_fn: LossFn, temperature: float, entropy: bool,
                   metrics: dict[str, float]) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches; returns the summed loss (last stage; 0
    elsewhere) and adds the loss function's metrics into `metrics`."""
    one = torch.ones((), dtype=torch.int, device=backend.device)

    def post(rows: slice, mb: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        out = backend._logprobs_of(logits, mb, temperature, entropy)
        if rows.start == rows.stop:  # a filler micro-batch (expert parallelism): no loss, a backward all the same
            loss, mb_metrics = out.logprobs.sum() * 0.0, {}
        else:
            loss, mb_metrics = loss_fn(mb, rows, out)
        return loss, one, {"loss": loss.detach(), "metrics": mb_metrics}

    total = torch.zeros((), dtype=torch.float64, device=backend.device)
    for item in _run(backend, backend.model, batch, post, forward_only=False):
        total += item["loss"]
        for k, v in item["metrics"].items():
            metrics[k] = metrics.get(k, 0.0) + v
    return total
