"""One rank of a multi-process Megatron backend with LoRA on CPU (gloo), for test_megatron_lora.py.

argv: MODEL_DIR ADAPTERS_DIR OUT_DIR TENSOR_PARALLEL; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come
from the environment. Every rank runs the same calls: the adapters are set from ADAPTERS_DIR (peft's
format, written by the torch backend), then logprobs, one train step, the adapters' gradients and new
values and the merged export, whole; a checkpoint saved and loaded into a second backend, whose
logprobs must be the first one's. Rank 0 saves what the test compares in OUT_DIR/out.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from slime_async.config.schema import LoraConfig, MegatronConfig, TrainConfig
from slime_async.train import lora as peft
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import build_batch
from slime_async.train.distributed import close_distributed
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories


def main(model_dir: str, adapters_dir: str, out: str, tp: int) -> None:
    def backend() -> MegatronBackend:
        return MegatronBackend(model_dir, device="cpu", micro_batch_size=2, optim=OptimizerSettings(lr=1e-3),
                               parallel=MegatronConfig(tensor_parallel=tp), lora=LoraConfig(rank=4, alpha=8.0))

    be = backend()
    be.set_adapters(peft.read_peft(Path(adapters_dir), be.adapter_names))
    batch = build_batch(make_trajectories(6, vocab=300), max_seq_len=64).batch
    assert batch is not None
    lp = be.logprobs(batch, 1.0)
    obj = Objective(TrainConfig(loss="grpo"))
    result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, lp.logprobs)), 1.0)
    grads = be.adapters(grad=True)
    adapters = be.adapters()
    merged = dict(be.named_weights())
    be.save(Path(out) / "ckpt")
    again = backend()
    again.load(Path(out) / "ckpt")
    resumed = torch.equal(again.logprobs(batch, 1.0).logprobs, be.logprobs(batch, 1.0).logprobs)
    if be.layout.rank == 0:
        torch.save({"logprobs": lp.logprobs, "loss": result.loss, "applied": result.applied,
                    "grad_norm": result.grad_norm, "grads": grads, "adapters": adapters, "merged": merged,
                    "resumed": resumed, "layout": (be.layout.tp, be.layout.dp)}, Path(out) / "out.pt")
    # gloo torn down with both ranks done (parallel_worker.py says why)
    torch.distributed.barrier()
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
