"""Tensor and data parallelism for real: two gloo processes on CPU against the one-process torch backend.

Under tensor parallelism 2 (Qwen3: QK-norm over each rank's own heads) every weight, the vocabulary
and the logits are split over two ranks (vocab-parallel log-softmax and entropy, sharded QKV and
fc1, gathered export); under data
parallelism 2 the micro-batches are dealt to two ranks and gradients summed across them. Either way
logprobs, entropies, loss, gradient norm and gradients equal the torch backend's, and the exported
weights equal the HF checkpoint's before the step.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import wait_all
from transformers import AutoModelForCausalLM

from slime_async.config.schema import TrainConfig
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend

WORKER = Path(__file__).with_name("parallel_worker.py")


def run_world(model_dir: Path, out: Path, tp: int, world: int = 2, timeout: float = 240) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(model_dir), str(out), str(tp)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, timeout)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp"), [("qwen3", 2), ("llama", 1)])
def test_two_ranks_compute_what_one_torch_process_computes(family: str, tp: int, family_dirs: dict[str, Path],
                                                           tmp_path: Path) -> None:
    got = run_world(family_dirs[family], tmp_path / "out.pt", tp)
    assert got["layout"] == (tp, 2 // tp)
    ref = TorchBackend(family_dirs[family], device="cpu", micro_batch_size=6,
                       optim=OptimizerSettings(lr=1e-3, grad_clip=0.01))
    batch = build_batch(make_trajectories(6, vocab=300), max_seq_len=64).batch
    assert batch is not None
    want = ref.logprobs(batch, 0.7, entropy=True)
    torch.testing.assert_close(got["logprobs"], want.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropy"], want.entropy, atol=1e-5, rtol=0)

    hf = dict(AutoModelForCausalLM.from_pretrained(family_dirs[family]).named_parameters())
    assert got["before"].keys() == hf.keys()
    for name, tensor in got["before"].items():
        assert torch.equal(tensor, hf[name]), name

    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    result = ref.train_step(batch, obj.loss_fn(obj.prepare(batch, ref.logprobs(batch, 1.0).logprobs)), 1.0,
                            entropy=True)
    assert got["applied"] and got["loss"] == pytest.approx(result.loss, rel=1e-5, abs=1e-7)
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert got["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)
    assert sum(not torch.equal(got["after"][n], got["before"][n]) for n in hf) > 10


LONE = """
import os, subprocess, sys, torch
from slime_async.train.megatron.parallel import init_parallel
init_parallel(1, 1, None, torch.device("cpu"))
assert not {"RANK", "MASTER_PORT"} & set(os.environ), "the lone world leaked into the environment"
if sys.argv[1] == "parent":  # a process it starts (a benchmark phase, a launched part) makes its own world
    subprocess.run([sys.executable, "-c", sys.argv[2], "child", ""], check=True, timeout=120)
print(sys.argv[1], "ok")
"""


def test_a_lone_world_leaves_the_environment_to_the_processes_it_starts() -> None:
    # a RANK/MASTER_PORT left in os.environ made a child join the parent's world on its port (EADDRINUSE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", LONE, "parent", LONE], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["child", "ok", "parent", "ok"]
