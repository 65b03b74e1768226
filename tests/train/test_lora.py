"""LoRA on the torch backend: only the adapters train and checkpoint; the merged weights reach a real
engine process, which then scores tokens exactly as the adapted trainer model does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slime_async.config import load_config
from slime_async.config.schema import LoraConfig, SyncConfig, TrainConfig
from slime_async.launch.process import start_engine
from slime_async.rollout.client import SGLangClient
from slime_async.sync import WeightPublisher
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend

REPO = Path(__file__).resolve().parents[2]


def batch() -> Batch:
    b = build_batch(make_trajectories(8, group_size=4), max_seq_len=64).batch
    assert b is not None
    return b


def lora_backend(model_dir: Path, **kw: object) -> TorchBackend:
    return TorchBackend(model_dir, device="cpu", optim=OptimizerSettings(lr=1e-2), lora=LoraConfig(rank=4, alpha=8.0),
                        **kw)  # type: ignore[arg-type]


def steps(be: TorchBackend, b: Batch, n: int = 3) -> None:
    obj = Objective(TrainConfig())
    for _ in range(n):
        assert be.train_step(b, obj.loss_fn(obj.prepare(b, None)), 1.0).applied


def test_adapters_start_at_the_base_model_and_alone_train(tiny_model_dir: Path) -> None:
    b = batch()
    full = TorchBackend(tiny_model_dir, device="cpu")
    be = lora_backend(tiny_model_dir)
    torch.testing.assert_close(be.logprobs(b, 1.0).logprobs, full.logprobs(b, 1.0).logprobs)  # B = 0
    # rank 4 on the 7 projections of 4 layers: 4 * 4 * (2*(256+256) + 2*(256+128) + 3*(256+768)) = 77,824
    assert be.num_trainable == 77_824 and be.num_trainable / be.num_parameters < 0.05
    base = {n: p.detach().clone() for n, p in be.model.named_parameters() if not p.requires_grad}
    steps(be, b)
    assert all(torch.equal(p, base[n]) for n, p in be.model.named_parameters() if n in base)
    assert not torch.allclose(be.logprobs(b, 1.0).logprobs, full.logprobs(b, 1.0).logprobs)


def test_checkpoints_hold_only_the_adapters_and_resume_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    b = batch()
    be = lora_backend(tiny_model_dir)
    steps(be, b)
    be.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt"]
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    tensors = load_file(tmp_path / "ckpt" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors  # peft's names
    assert sum(t.numel() for t in tensors.values()) == be.num_trainable
    again = lora_backend(tiny_model_dir)
    again.load(tmp_path / "ckpt")
    torch.testing.assert_close(again.logprobs(b, 1.0).logprobs, be.logprobs(b, 1.0).logprobs, atol=0, rtol=0)
    steps(be, b, 1)
    steps(again, b, 1)  # the optimizer state came back too: the next step is the same
    torch.testing.assert_close(again.logprobs(b, 1.0).logprobs, be.logprobs(b, 1.0).logprobs, atol=0, rtol=0)


def test_a_checkpoint_of_the_other_kind_is_refused_in_words(tiny_model_dir: Path, tmp_path: Path) -> None:
    lora, full = lora_backend(tiny_model_dir), TorchBackend(tiny_model_dir, device="cpu")
    lora.save(tmp_path / "adapters")
    full.save(tmp_path / "full")
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors, so no LoRA adapters: a checkpoint of full"):
        lora_backend(tiny_model_dir).load(tmp_path / "full")
    with pytest.raises(ValueError, match=r"LoRA adapters, not full weights: this run was trained with train\.lora"):
        TorchBackend(tiny_model_dir, device="cpu").load(tmp_path / "adapters")


def test_bad_targets_are_refused_naming_the_field(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"train.lora.target_modules: \['qkv'\] names no linear layer.*q_proj"):
        TorchBackend(tiny_model_dir, device="cpu", lora=LoraConfig(target_modules=["qkv"]))
    # the tiny model ties its output layer to the embedding
    with pytest.raises(ValueError, match=r"train.lora.target_modules: 'lm_head' is the output layer, whose weight"):
        TorchBackend(tiny_model_dir, device="cpu", lora=LoraConfig(target_modules=["q_proj", "lm_head"]))
    assert load_config(REPO / "configs/local.yaml", ["train.lora={rank: 4}"]).train.lora.rank == 4


async def test_the_merged_weights_reach_an_engine_which_then_scores_as_the_trainer(
        tiny_model_dir: Path, varied_model_dir: Path) -> None:
    b = batch()
    be = lora_backend(varied_model_dir)
    steps(be, b)
    names = dict(be.named_weights())
    # the 7 adapted projections of 4 layers, and Qwen2's q, k, v biases (frozen, sent along): nothing else
    assert sum(n.endswith(".weight") for n in names) == 4 * 7 and sum(n.endswith(".bias") for n in names) == 4 * 3
    assert len(names) == 40 and not any("lora" in n or "base" in n for n in names)
    engine = start_engine(varied_model_dir, "--max-batch-size", "4", "--context-length", "512")
    try:
        publisher = WeightPublisher([engine.url], SyncConfig())
        report = await publisher.publish(be.named_weights, 1)
        await publisher.close()
        assert not report.failed and report.bytes == sum(t.numel() * 4 for t in names.values())
        ids = b.input_ids[0][b.attention_mask[0] > 0].numpy().astype(np.int32)
        async with SGLangClient([engine.url]) as client:
            (served,) = await client.score([ids], [1])
    finally:
        engine.stop()
    mine = be.logprobs(b, 1.0).logprobs[0, 1:len(ids)].numpy()
    np.testing.assert_allclose(served, mine, atol=1e-4)
