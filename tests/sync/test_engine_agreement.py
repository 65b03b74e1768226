"""The trainer and a real engine process agree (η = 0, fp32, CPU).

Behaviour logprobs that the engine returns over HTTP (temperature 1, return_logprob) equal the torch
backend's recomputed logprobs to 1e-5, so the first step's ratio is exactly 1 and every importance
weight is 1; and after the loop publishes a step, the engine's greedy output is exactly what the
trainer's own model predicts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import PROMPT, engine_greedy, hf_greedy, post

from slime_async.config.schema import SyncConfig, TrainConfig
from slime_async.sync import WeightPublisher
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import build_batch
from slime_async.train.loop import StepRecord, Trainer
from slime_async.train.memory_source import InMemorySource
from slime_async.train.torch_backend import TorchBackend
from slime_async.types import StopReason, Trajectory, Turn

PROMPTS = [[1, 2, 3], [40, 41], [100, 7, 300, 2]]
GROUP = 4


async def sample(url: str, prompt: list[int], group: str, index: int) -> Trajectory:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}}
    status, out = await post(url, "/generate", body)
    assert status == 200, out
    meta: dict[str, Any] = out["meta_info"]
    versions = np.zeros(len(out["output_ids"]), dtype=np.int32)
    for span in meta["weight_versions"]:
        versions[span["start"]:span["end"]] = int(span["version"])
    turn = Turn(prompt_ids=prompt, completion_ids=out["output_ids"],
                logprobs=[lp for lp, _, _ in meta["output_token_logprobs"]], versions=versions)
    # a reward that differs within the group, so that advantages are not all 0
    return Trajectory(task_id=group, group_id=group, sample_index=index, turns=[turn],
                      stop_reason=StopReason.DONE, reward=float(out["output_ids"][0] % 3))


@pytest.mark.slow
async def test_engine_and_trainer_agree_and_a_push_changes_greedy_output_as_predicted(
        engine: Any, varied_dir: Path) -> None:
    trajs = await asyncio.gather(*(sample(engine.url, p, f"g{i}", j)
                                   for i, p in enumerate(PROMPTS) for j in range(GROUP)))
    assert all(t.min_version() == 0 for t in trajs)  # η = 0: every token from the trainer's version

    backend = TorchBackend(varied_dir, device="cpu", dtype="float32", optim=OptimizerSettings(lr=2e-2),
                           micro_batch_size=4)
    batch = build_batch(list(trajs), max_seq_len=64).batch
    assert batch is not None and len(batch) == len(PROMPTS) * GROUP
    prox = backend.logprobs(batch, temperature=1.0).logprobs
    m = batch.loss_mask.bool()
    assert int(m.sum()) == len(trajs) * 12
    diff = (prox[m] - batch.behaviour_logprobs[m]).abs().max().item()
    assert diff <= 1e-5, f"engine and trainer logprobs differ by {diff}"

    before = {tuple(p): hf_greedy(backend.model, p) for p in [PROMPT, *PROMPTS]}
    records: list[StepRecord] = []
    async with WeightPublisher([engine.url], SyncConfig(bucket_mb=1.0)) as publisher:
        trainer = Trainer(TrainConfig(loss="decoupled_ppo", grad_clip=0.0), backend, InMemorySource(list(trajs)),
                          batch_size=len(trajs), temperature=1.0, publisher=publisher, on_step=records.append)
        await trainer.run(until_version=1)
    first = records[0]
    assert first.metrics["ratio_min"] == 1.0 and first.metrics["ratio_max"] == 1.0  # exactly
    assert first.metrics["clip_fraction"] == 0.0
    assert first.metrics["max_abs_dp"] <= 1e-5 and abs(first.metrics["ess"] - 1.0) <= 1e-6  # weights all 1
    assert first.publish is not None and first.publish.updated == [engine.url] and first.publish.buckets > 1

    changed = 0
    for prompt, old in before.items():
        predicted = hf_greedy(backend.model, list(prompt))
        assert await engine_greedy(engine.url, list(prompt)) == (predicted, "1")
        changed += predicted != old
    assert changed > 0, "the step changed no greedy output: the comparison would prove nothing"
    backend.model.zero_grad(set_to_none=True)
    assert torch.isfinite(prox).all()


@pytest.mark.slow
async def test_resumed_trainer_brings_a_restarted_engine_up_to_date_and_continues(
        engine: Any, varied_dir: Path, tmp_path: Path) -> None:
    trajs = [await sample(engine.url, p, f"r{i}", j) for i, p in enumerate(PROMPTS[:2]) for j in range(2)]
    cfg = TrainConfig(lr=1e-2, checkpoint_every=1, micro_batch_size=4)

    def trainer(source: InMemorySource, publisher: WeightPublisher) -> Trainer:
        backend = TorchBackend(varied_dir, device="cpu", optim=OptimizerSettings(lr=cfg.lr), micro_batch_size=4)
        return Trainer(cfg, backend, source, batch_size=2, publisher=publisher, checkpoint_dir=tmp_path,
                       extra_state={"data": source})

    async with WeightPublisher([engine.url], SyncConfig()) as publisher:
        first = trainer(InMemorySource(trajs), publisher)
        await first.run(until_version=1)
        first_weights = {n: t.clone() for n, t in first.backend.named_weights()}
        # the engine restarts from the initial checkpoint: version 0, initial weights
        initial = TorchBackend(varied_dir, device="cpu")
        await publisher.publish(initial.named_weights, 0)
        assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(initial.model, PROMPT), "0")

        source = InMemorySource(trajs)
        second = trainer(source, publisher)
        assert second.resume() and second.version == 1 and source.offset == 2
        for name, t in second.backend.named_weights():
            assert torch.equal(t, first_weights[name])
        reconciled = second.counters["engines_reconciled"]  # restored from the checkpoint
        await second.run(until_version=2)
    assert second.counters["engines_reconciled"] == reconciled + 1  # found on version 0 before training went on
    assert second.version == 2 and source.versions_seen[-1] == 2
    assert await engine_greedy(engine.url, PROMPT) == (hf_greedy(second.backend.model, PROMPT), "2")
