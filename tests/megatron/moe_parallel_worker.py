"""One rank of a two-process Megatron backend on a MoE model (CPU, gloo), for test_moe_parity.py;
`run_step` is also what the test runs in one process to compare.

argv: MODEL_DIR OUT_FILE LAYOUT; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
LAYOUT is one of `LAYOUTS`. Rank 0 saves logprobs, the loss, metrics and grad norm of one step, and the
exported weights before and after it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from slime_async.config.schema import MegatronConfig, MoeConfig, TrainConfig
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.distributed import close_distributed
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories

LAYERS, K, EXPERTS = 4, 2, 8
LAYOUTS = {
    # data parallel 2, experts split over the two data-parallel ranks; no replay, no router losses
    "ep2": MegatronConfig(expert_parallel=2),
    # tensor (and so sequence) parallel 2, whole experts on both ranks; replay and router losses
    "tp2": MegatronConfig(tensor_parallel=2),
    # tensor parallel 2 and the experts split over those same two ranks; replay and router losses
    "tp2_ep2": MegatronConfig(tensor_parallel=2, expert_parallel=2),
}


def moe_config(layout: str) -> MoeConfig:
    return MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.0) if layout == "ep2" else MoeConfig(aux_loss_coef=0.3,
                                                                                         z_loss_coef=0.02)


def step_batch(layout: str) -> Batch:
    """6 rows; outside `ep2` with a routing record of random distinct experts (every fifth position
    unreported), which the model's own choice mostly is not."""
    batch = build_batch(make_trajectories(6, vocab=882), max_seq_len=64).batch
    assert batch is not None
    if layout == "ep2":
        return batch
    n, t = batch.input_ids.shape
    g = torch.Generator().manual_seed(7)
    routes = torch.rand(n, t, LAYERS, EXPERTS, generator=g).argsort(dim=-1)[..., :K].reshape(n, t, LAYERS * K)
    routes[:, ::5] = -1
    return dataclasses.replace(batch, routed_experts=routes.to(torch.int16))


def run_step(be: MegatronBackend, layout: str) -> dict[str, Any]:
    """Logprobs, one GRPO step and the weights around it, on 6 rows in micro-batches of 2 (3 of them:
    with data parallelism one rank runs a filler micro-batch so that both take part in every all-to-all)."""
    batch = step_batch(layout)
    lp = be.logprobs(batch, 0.7)
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    before = {n: t.clone() for n, t in be.named_weights()}
    result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0,
                           entropy=True)
    assert result.applied
    return {"logprobs": lp.logprobs, "loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics,
            "before": before, "after": dict(be.named_weights()),
            "layout": (be.layout.tp, be.layout.dp, be.layout.ep)}


def backend(model_dir: str | Path, layout: str, parallel: MegatronConfig | None = None) -> MegatronBackend:
    """The backend of `layout` (one process: `parallel` None)."""
    # Adam eps 1e-6: see test_moe_parity.test_one_train_step_equals_the_torch_backends
    return MegatronBackend(model_dir, device="cpu", micro_batch_size=2,
                           optim=OptimizerSettings(lr=1e-3, eps=1e-6, grad_clip=0.01), parallel=parallel,
                           moe=moe_config(layout))


def main(model_dir: str, out: str, layout: str) -> None:
    be = backend(model_dir, layout, LAYOUTS[layout])
    got = run_step(be, layout)
    if be.layout.rank == 0:
        torch.save(got, out)
    torch.distributed.barrier()  # both ranks done before gloo is torn down (see parallel_worker.py)
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
