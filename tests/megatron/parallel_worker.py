"""One rank of a multi-process Megatron backend on CPU (gloo), for test_parallel.py.

argv: MODEL_DIR OUT_FILE TENSOR_PARALLEL; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the
environment. Every rank runs the same calls; rank 0 saves what the test compares: logprobs and
entropies, the loss, grad norm and gradients (gathered whole, in HF names) of one step, and the
exported weights before and after it.
"""

from __future__ import annotations

import sys

import torch

from slime_async.config.schema import MegatronConfig, TrainConfig
from slime_async.sync import megatron_names as names
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import build_batch
from slime_async.train.distributed import close_distributed
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.megatron.weights import _gather_tp, global_names
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories


def main(model_dir: str, out: str, tp: int) -> None:
    be = MegatronBackend(model_dir, device="cpu", micro_batch_size=2, optim=OptimizerSettings(lr=1e-3, grad_clip=0.01),
                         parallel=MegatronConfig(tensor_parallel=tp))
    batch = build_batch(make_trajectories(6, vocab=300), max_seq_len=64).batch
    assert batch is not None
    lp = be.logprobs(batch, 0.7, entropy=True)
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    before = {n: t.clone() for n, t in be.named_weights()}
    prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
    result = be.train_step(batch, obj.loss_fn(prep), 1.0, entropy=True)
    grads = {}
    for name, p in global_names(be.module):
        if names.exported(name, be.geometry):
            s = names.slot(name, be.geometry)
            full = _gather_tp(p.grad, s, be.layout)
            grads.update(zip(s.hf_names, names.to_hf(s, full, be.geometry), strict=True))
    after = dict(be.named_weights())
    if be.layout.rank == 0:
        torch.save({"logprobs": lp.logprobs, "entropy": lp.entropy, "loss": result.loss, "applied": result.applied,
                    "grad_norm": result.grad_norm, "grads": grads, "before": before, "after": after,
                    "layout": (be.layout.tp, be.layout.dp)}, out)
    # Tear gloo down here, both ranks done: left to the interpreter's exit, its threads died in C++
    # static destructors ("terminate called without an active exception"): once in three full runs.
    torch.distributed.barrier()
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
