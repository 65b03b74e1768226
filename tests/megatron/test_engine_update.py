"""Weights exported by the Megatron backend drive a real engine process's in-place update."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hf_greedy, perturbed, post
from transformers import AutoModelForCausalLM

from slime_async.config.schema import SyncConfig, TrainConfig
from slime_async.launch.process import start_engine
from slime_async.sync import WeightPublisher
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import build_batch
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [40, 41], [100, 7, 300, 2]]


@pytest.fixture(scope="module")
def varied(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (tokenizer included) with weights whose greedy output varies."""
    out = tmp_path_factory.mktemp("mvaried")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=1, std=0.05).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(varied: Path) -> Iterator[Any]:
    server = start_engine(varied, "--max-batch-size", "4", "--context-length", "256")
    yield server
    server.stop()


async def greedy(url: str, ids: list[int], n: int = 16) -> tuple[list[int], str]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    status, out = await post(url, "/generate", body)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.mark.slow
async def test_exported_weights_change_the_engines_greedy_output_exactly_as_predicted(engine: Any, varied: Path
                                                                                       ) -> None:
    backend = MegatronBackend(varied, device="cpu", optim=OptimizerSettings(lr=2e-2), micro_batch_size=4)
    before = AutoModelForCausalLM.from_pretrained(varied).eval()
    for p in PROMPTS:
        assert await greedy(engine.url, p) == (hf_greedy(before, p, 16), "0")

    batch = build_batch(make_trajectories(8, vocab=800), max_seq_len=64).batch
    assert batch is not None
    obj = Objective(TrainConfig(loss="grpo", grad_clip=0.0))
    assert backend.train_step(batch, obj.loss_fn(obj.prepare(batch, backend.logprobs(batch, 1.0).logprobs)), 1.0
                              ).applied
    async with WeightPublisher([engine.url], SyncConfig(bucket_mb=1.0)) as publisher:
        report = await publisher.publish(backend.named_weights, 1)
    assert report.updated == [engine.url] and not report.failed and report.buckets > 1

    # what the engine must now compute: transformers' own model holding the exported tensors
    predicted = AutoModelForCausalLM.from_pretrained(varied).eval()
    with torch.no_grad():
        result = predicted.load_state_dict(dict(backend.named_weights()), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    changed = 0
    for p in PROMPTS:
        want = hf_greedy(predicted, p, 16)
        assert await greedy(engine.url, p) == (want, "1")
        changed += want != hf_greedy(before, p, 16)
    assert changed >= 2  # the update is visible, not a no-op that would pass by itself
