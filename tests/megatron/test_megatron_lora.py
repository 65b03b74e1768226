"""LoRA on the Megatron backend against LoRA on the torch backend (CPU, fp32): the same adapters (copied
from the torch model, B made non-zero so that every gradient is) give the same logprobs, loss, adapter
gradients, updated adapters and merged weights; checkpoints are peft's format, the torch backend's
names and shapes, and resume exactly; under tensor parallelism 2 (two gloo processes) the same again;
the merged weights equal the torch backend's, which tests/train/test_lora.py publishes to a real
engine process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import wait_all
from safetensors.torch import load_file

from slime_async.config import load_config
from slime_async.config.schema import LoraConfig, MegatronConfig, TrainConfig
from slime_async.train.backend import OptimizerSettings, StepResult
from slime_async.train.batch import Batch, build_batch
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.megatron.weights import global_names
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("lora_worker.py")
LR = 1e-3


def batch_of() -> Batch:
    b = build_batch(make_trajectories(6, vocab=300), max_seq_len=64).batch
    assert b is not None
    return b


def torch_lora(model_dir: Path, lora: LoraConfig) -> TorchBackend:
    """The torch backend with LoRA, its B seeded noise (B = 0 would leave A's gradient zero)."""
    be = TorchBackend(model_dir, device="cpu", micro_batch_size=6, optim=OptimizerSettings(lr=LR), lora=lora)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in be.lora_layers.values():
            m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return be


def mega_lora(model_dir: Path, lora: LoraConfig, **kw: object) -> MegatronBackend:
    return MegatronBackend(model_dir, device="cpu", micro_batch_size=2, optim=OptimizerSettings(lr=LR), lora=lora,
                           **kw)  # type: ignore[arg-type]


def step(be: MegatronBackend | TorchBackend, b: Batch) -> StepResult:
    obj = Objective(TrainConfig(loss="grpo"))
    result = be.train_step(b, obj.loss_fn(obj.prepare(b, be.logprobs(b, 1.0).logprobs)), 1.0)
    assert result.applied
    return result


def test_adapters_start_at_the_base_model_and_alone_train(family_dirs: dict[str, Path]) -> None:
    b, lora = batch_of(), LoraConfig(rank=4, alpha=8.0)
    be = mega_lora(family_dirs["qwen2"], lora)
    base = MegatronBackend(family_dirs["qwen2"], device="cpu", micro_batch_size=2)
    assert torch.equal(be.logprobs(b, 1.0).logprobs, base.logprobs(b, 1.0).logprobs)  # B = 0
    # rank 4 on the 7 projections of 2 layers: 2 * 4 * (2*(64+64) + 2*(64+32) + 3*(64+96)) = 7,424
    assert be.num_trainable == 7_424 == TorchBackend(family_dirs["qwen2"], device="cpu", lora=lora).num_trainable
    adapters = {id(p) for n, p in be.module.named_parameters() if ".lora." in n}
    assert {id(p) for p in be.optimizer.params} == adapters and len(adapters) == 2 * 7 * 2
    frozen = {n: p.detach().clone() for n, p in global_names(be.module)}
    step(be, b)
    assert all(torch.equal(p, frozen[n]) for n, p in global_names(be.module))
    assert not torch.equal(be.logprobs(b, 1.0).logprobs, base.logprobs(b, 1.0).logprobs)


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # some modules of a fused layer left out: theirs rows of linear_qkv / linear_fc1 get nothing
    ("llama", ["k_proj", "o_proj", "up_proj", "down_proj"]),
])
def test_one_step_equals_the_torch_backends_lora(family: str, targets: list[str], family_dirs: dict[str, Path]
                                                 ) -> None:
    b, lora = batch_of(), LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    ref = torch_lora(family_dirs[family], lora)
    be = mega_lora(family_dirs[family], lora)
    assert be.adapter_names == list(ref.lora_layers)
    be.set_adapters({n: (m.lora_A.detach(), m.lora_B.detach()) for n, m in ref.lora_layers.items()})
    torch.testing.assert_close(be.logprobs(b, 1.0).logprobs, ref.logprobs(b, 1.0).logprobs, atol=1e-5, rtol=0)
    got, want = step(be, b), step(ref, b)
    assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5) and want.grad_norm > 0
    for name, (ga, gb) in be.adapters(grad=True).items():
        m = ref.lora_layers[name]
        assert m.lora_A.grad is not None and m.lora_A.grad.abs().sum() > 0, name
        torch.testing.assert_close(ga, m.lora_A.grad, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(gb, m.lora_B.grad, atol=1e-6, rtol=1e-4, msg=name)
    # Adam's first step is lr * g / (|g| + eps): near-zero gradients amplify rounding, so lr / 10
    for name, (a, bb) in be.adapters().items():
        torch.testing.assert_close(a, ref.lora_layers[name].lora_A.detach(), atol=LR / 10, rtol=0, msg=name)
        torch.testing.assert_close(bb, ref.lora_layers[name].lora_B.detach(), atol=LR / 10, rtol=0, msg=name)
    # the publish: the adapted modules' merged weights (and Qwen2's q/k/v biases), nothing else
    mine, theirs = list(be.named_weights()), list(ref.named_weights())
    assert [n for n, _ in mine] == [n for n, _ in theirs]
    for (name, w), (_, v) in zip(mine, theirs, strict=True):
        torch.testing.assert_close(w, v, atol=1e-4, rtol=0, msg=name)
    biases = 2 * 3 if family == "qwen2" else 0
    assert len(mine) == 2 * len(targets) + biases
    # to engines that load adapters themselves (vLLM): the adapters, under the torch backend's peft names
    be.publish_adapters = ref.publish_adapters = True
    mine, theirs = list(be.named_weights()), list(ref.named_weights())
    assert [n for n, _ in mine] == [n for n, _ in theirs] and len(mine) == 2 * 2 * len(targets)
    assert all(n.startswith("base_model.model.model.layers.") and ".lora_" in n for n, _ in mine)
    for (name, w), (_, v) in zip(mine, theirs, strict=True):
        torch.testing.assert_close(w, v, atol=LR / 10, rtol=0, msg=name)


def test_checkpoints_are_peft_adapters_and_resume_exactly(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    b, lora = batch_of(), LoraConfig(rank=4, alpha=8.0)
    be = mega_lora(family_dirs["qwen2"], lora)
    step(be, b)
    be.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "megatron.json", "optimizer_tp00_pp00_dp000.pt"]
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    # the torch backend's checkpoint: the same tensor names and shapes
    TorchBackend(family_dirs["qwen2"], device="cpu", lora=lora).save(tmp_path / "torch")
    mine, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ckpt", "torch"))
    assert {n: t.shape for n, t in mine.items()} == {n: t.shape for n, t in theirs.items()}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in mine
    again = mega_lora(family_dirs["qwen2"], lora)
    again.load(tmp_path / "ckpt")
    assert torch.equal(again.logprobs(b, 1.0).logprobs, be.logprobs(b, 1.0).logprobs)
    step(be, b)
    step(again, b)  # the optimizer state came back too: the next step is the same
    assert torch.equal(again.logprobs(b, 1.0).logprobs, be.logprobs(b, 1.0).logprobs)
    # the other kind of checkpoint is refused in words, either way
    full = MegatronBackend(family_dirs["qwen2"], device="cpu")
    full.save(tmp_path / "full")
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors, so no LoRA adapters: a checkpoint of full"):
        mega_lora(family_dirs["qwen2"], lora).load(tmp_path / "full")
    with pytest.raises(ValueError, match=r"LoRA adapters, not full weights: this run was trained with train\.lora"):
        full.load(tmp_path / "ckpt")


def test_what_the_adapters_do_not_cover_is_refused_naming_the_field(family_dirs: dict[str, Path],
                                                                    tiny_moe_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"train\.lora\.target_modules: the megatron backend adapts .*\['lm_head'\]"):
        mega_lora(family_dirs["qwen2"], LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"train\.lora: train\.megatron\.tensor_parallel 2 must divide the 1 key/"):
        mega_lora(family_dirs["llama"], LoraConfig(), parallel=MegatronConfig(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"train\.lora: the megatron backend adapts dense models"):
        mega_lora(tiny_moe_dir, LoraConfig())
    with pytest.raises(ValueError, match=r"train\.megatron\.attention: te fuses the layer norm"):
        mega_lora(family_dirs["qwen2"], LoraConfig(), parallel=MegatronConfig(attention="te"))
    cfg = load_config(REPO / "configs/local.yaml", ["train.lora={rank: 4}", "train.backend=megatron"])
    assert cfg.train.lora is not None and cfg.train.backend == "megatron"


@pytest.mark.slow
def test_tensor_parallel_two_computes_what_the_torch_backend_computes(family_dirs: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """Qwen3 (QK-norm, 2 key/value heads) split over two gloo processes: each holds half of every B of
    linear_qkv / linear_fc1 and half of every A of linear_proj / linear_fc2."""
    b, lora = batch_of(), LoraConfig(rank=4, alpha=8.0)
    ref = torch_lora(family_dirs["qwen3"], lora)
    ref.save(tmp_path / "adapters")  # the worker starts from these adapters (non-zero B)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(family_dirs["qwen3"]),
                                       str(tmp_path / "adapters"), str(tmp_path), "2"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, 240)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert got["layout"] == (2, 1) and got["applied"]
    torch.testing.assert_close(got["logprobs"], ref.logprobs(b, 1.0).logprobs, atol=1e-5, rtol=0)
    want = step(ref, b)
    assert got["loss"] == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-5)
    assert list(got["grads"]) == list(ref.lora_layers)
    for name, m in ref.lora_layers.items():
        ga, gb = got["grads"][name]
        torch.testing.assert_close(ga, m.lora_A.grad, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(gb, m.lora_B.grad, atol=1e-6, rtol=1e-4, msg=name)
        a, bb = got["adapters"][name]
        torch.testing.assert_close(a, m.lora_A.detach(), atol=LR / 10, rtol=0, msg=name)
        torch.testing.assert_close(bb, m.lora_B.detach(), atol=LR / 10, rtol=0, msg=name)
    theirs = list(ref.named_weights())
    assert list(got["merged"]) == [n for n, _ in theirs]
    for name, w in theirs:
        torch.testing.assert_close(got["merged"][name], w, atol=1e-4, rtol=0, msg=name)
    assert got["resumed"]  # a checkpoint saved by two ranks loads back into two ranks exactly
