"""One rank of a two-process Megatron backend on a MoE model, expert parallel 2 (CPU, gloo), for
test_moe_parity.py; `run_step` is also what the test runs in one process to compare.

argv: MODEL_DIR OUT_FILE; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
Rank 0 saves logprobs, the loss and grad norm of one step, and the exported weights before and after it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from trajectories import make_trajectories

from slime_async.config.schema import MegatronConfig, MoeConfig, TrainConfig
from slime_async.train.batch import build_batch
from slime_async.train.distributed import close_distributed
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.objective import Objective


def run_step(be: MegatronBackend) -> dict[str, Any]:
    """Logprobs, one GRPO step and the weights around it, on 6 rows in micro-batches of 2 (3 of them:
    one data-parallel rank runs a filler micro-batch so that both take part in every all-to-all)."""
    batch = build_batch(make_trajectories(6, vocab=882), max_seq_len=64).batch
    assert batch is not None
    lp = be.logprobs(batch, 0.7)
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    before = {n: t.clone() for n, t in be.named_weights()}
    result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0,
                           entropy=True)
    assert result.applied
    return {"logprobs": lp.logprobs, "loss": result.loss, "grad_norm": result.grad_norm, "before": before,
            "after": dict(be.named_weights()), "layout": (be.layout.dp, be.layout.ep)}


def main(model_dir: str, out: str) -> None:
    be = MegatronBackend(model_dir, device="cpu", micro_batch_size=2, lr=1e-3, eps=1e-6, grad_clip=0.01,
                         parallel=MegatronConfig(expert_parallel=2),
                         moe=MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.0))
    got = run_step(be)
    if be.layout.rank == 0:
        torch.save(got, out)
    torch.distributed.barrier()  # both ranks done before gloo is torn down (see parallel_worker.py)
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
