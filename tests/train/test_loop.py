"""The continuous loop over an in-memory batch source and the real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_async.config.schema import TrainConfig
from slime_async.sync.publisher import NamedWeights, PublishReport
from slime_async.train.backend import OptimizerSettings, StepResult
from slime_async.train.loop import BatchSource, StepRecord, Trainer
from slime_async.train.memory_source import InMemorySource
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend


class RecordingSink:
    """Stands in for the publisher where only the loop's calls matter (engines: tests/sync)."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []
        self.reconciled: list[int] = []

    async def publish(self, weights: NamedWeights, version: int) -> PublishReport:
        self.published.append((version, len(list(weights()))))
        return PublishReport(version=version, seconds=0.0, bytes=0, buckets=1, updated=["x"])

    async def reconcile(self, weights: NamedWeights, version: int) -> list[str]:
        self.reconciled.append(version)
        return []


def make(model_dir: Path, source: BatchSource, checkpoint_dir: Path | None = None, **cfg: object
         ) -> tuple[Trainer, list[StepRecord], RecordingSink]:
    torch.manual_seed(0)
    tc = TrainConfig(**{"lr": 1e-3, "micro_batch_size": 2, "batch_timeout_s": 0.01, "checkpoint_every": 0, **cfg})
    records: list[StepRecord] = []
    sink = RecordingSink()
    backend = TorchBackend(model_dir, device="cpu", optim=OptimizerSettings(lr=tc.lr),
                           micro_batch_size=tc.micro_batch_size,
                           reference=tc.kl_coef > 0)
    trainer = Trainer(tc, backend, source, batch_size=4, publisher=sink, checkpoint_dir=checkpoint_dir,
                      extra_state={"data": source} if isinstance(source, InMemorySource) else None,
                      on_step=records.append)
    return trainer, records, sink


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backend.named_weights()}


async def test_loop_steps_bumps_version_publishes_and_tells_the_source(tiny_model_dir: Path) -> None:
    source = InMemorySource(make_trajectories(12))
    trainer, records, sink = make(tiny_model_dir, source)
    before = weights(trainer)
    await trainer.run(until_version=3)
    assert trainer.version == 3
    assert [r.version for r in records] == [1, 2, 3] and all(r.applied == 1 for r in records)
    n_weights = len(before)
    assert sink.published == [(1, n_weights), (2, n_weights), (3, n_weights)]
    assert sink.reconciled == [0]  # engines caught up before training starts
    assert source.versions_seen == [0, 1, 2, 3]
    assert trainer.counters["trajectories_trained"] == 12
    # first step of each batch: proximal recomputed from the same weights, so the ratio is exactly 1
    assert records[0].metrics["ratio_min"] == records[0].metrics["ratio_max"] == 1.0
    assert records[0].metrics["clip_fraction"] == 0.0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.backend.named_weights())
    for r in records:  # the step's time split: its parts, none negative, within the whole
        assert set(r.times) == {"wait_s", "batch_s", "recompute_s", "train_s"} and r.publish is not None
        assert min(r.times.values()) >= 0 and r.times["train_s"] > 0
        assert sum(r.times.values()) + r.publish.seconds <= r.seconds


async def test_proximal_from_the_training_forward_equals_a_recomputed_one(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step per batch: the loss takes the proximal logprobs from its own forward, with no extra
    pass, and trains exactly as when they are recomputed first (here forced by an outlier mask whose
    bounds mask nothing)."""
    passes: list[str] = []
    real = TorchBackend.logprobs

    def counting(self: TorchBackend, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        passes.append("logprobs")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "logprobs", counting)
    runs = {}
    for name, extra in {"fused": {}, "recompute": {"outlier_mask": "token", "outlier_low": 1e-9,
                                                  "outlier_high": 1e9}}.items():
        passes.clear()
        trainer, records, _ = make(tiny_model_dir, InMemorySource(make_trajectories(8)), **extra)
        await trainer.run(until_version=2)
        runs[name] = (weights(trainer), records, len(passes))
    (fused_w, fused_r, fused_passes), (ref_w, ref_r, ref_passes) = runs["fused"], runs["recompute"]
    assert (fused_passes, ref_passes) == (0, 2)
    for name, tensor in ref_w.items():
        torch.testing.assert_close(fused_w[name], tensor)
    for a, b in zip(fused_r, ref_r, strict=True):
        # the engine's logprobs (-1) are not this model's: the behaviour weights are far from 1
        assert a.metrics["behav_prox_kl_k1"] > 0.1
        for key in ("behav_prox_kl_k1", "ess", "ratio_max", "pg_loss"):
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-5, abs=1e-6)


async def test_several_steps_per_batch_add_staleness(tiny_model_dir: Path) -> None:
    source = InMemorySource(make_trajectories(8))
    trainer, records, sink = make(tiny_model_dir, source, steps_per_batch=2)
    await trainer.run(until_version=4)
    assert [(r.version, r.applied, r.max_staleness) for r in records] == [(2, 2, 1), (4, 2, 3)]
    assert [v for v, _ in sink.published] == [2, 4]  # one publish per batch, after its last step


async def test_behaviour_as_proximal_uses_engine_logprobs(tiny_model_dir: Path) -> None:
    source = InMemorySource(make_trajectories(4))  # behaviour logprobs are all -1: not this model's
    trainer, records, _ = make(tiny_model_dir, source, proximal="behaviour")
    await trainer.run(until_version=1)
    assert records[0].metrics["ratio_max"] != 1.0
    assert records[0].metrics["behav_prox_kl_k1"] == 0.0  # proximal is behaviour


async def test_empty_and_bad_batches_are_counted_not_trained(tiny_model_dir: Path) -> None:
    bad = make_trajectories(4)
    for t in bad:
        t.reward = float("nan")
    source = InMemorySource(bad)
    trainer, _, sink = make(tiny_model_dir, source)
    assert await trainer.step() is None  # all skipped
    assert await trainer.step() is None  # source exhausted: empty
    assert trainer.version == 0 and not sink.published
    assert trainer.counters["skipped:nan_reward"] == 4 and trainer.counters["empty_batches"] == 2
    assert sink.reconciled == [0]  # idle time catches engines up


async def test_a_skipped_step_keeps_the_version(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = InMemorySource(make_trajectories(4))
    trainer, _, sink = make(tiny_model_dir, source)
    monkeypatch.setattr(trainer.backend, "train_step",
                        lambda *a, **k: StepResult(False, float("nan"), 0.0, reason="non-finite loss"))
    record = await trainer.step()
    assert record is not None and record.applied == 0 and record.skipped_steps == ["non-finite loss"]
    assert trainer.version == 0 and trainer.counters["skipped_steps"] == 1 and not sink.published
    assert trainer.counters["skipped:step_not_applied"] == 4 and trainer.counters["trajectories_trained"] == 0


async def test_kl_and_entropy_terms_run(tiny_model_dir: Path) -> None:
    for kl_in in ("loss", "reward"):
        source = InMemorySource(make_trajectories(4))
        trainer, records, _ = make(tiny_model_dir, source, kl_coef=0.1, kl_in=kl_in, entropy_coef=0.01,
                                   loss="gspo")
        await trainer.run(until_version=1)
        assert records[0].metrics["entropy"] > 0
        if kl_in == "loss":
            assert records[0].metrics["kl_ref"] == 0.0  # the reference is the initial policy


async def test_two_half_runs_equal_one_whole_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = make_trajectories(16, seed=3)
    whole, _, _ = make(tiny_model_dir, InMemorySource(data), tmp_path / "whole")
    await whole.run(until_version=4)

    first_source = InMemorySource(data)
    first, _, _ = make(tiny_model_dir, first_source, tmp_path / "half")
    await first.run(until_version=2)  # saves a checkpoint at the end
    second_source = InMemorySource(data)
    second, _, sink = make(tiny_model_dir, second_source, tmp_path / "half")
    assert second.resume()
    assert second.version == 2 and second_source.offset == 8  # nothing trained twice, nothing skipped
    await second.run(until_version=4)
    assert second.version == 4 and second.counters["trajectories_trained"] == 16
    assert [v for v, _ in sink.published] == [3, 4]
    w = weights(whole)
    for name, p in weights(second).items():
        assert torch.equal(p, w[name]), name
    # the optimizer state is part of it too: moments equal
    sa, sb = whole.backend.optimizer.state_dict()["state"], second.backend.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


async def test_build_trainer_from_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    from slime_async.config import Config
    from slime_async.train.build import build_trainer

    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    cfg.model.device = "cpu"
    cfg.run.dir = str(tmp_path)
    cfg.rollout.batch_size = 4
    cfg.train.micro_batch_size = 2
    source = InMemorySource(make_trajectories(4))
    trainer = build_trainer(cfg, source, engine_urls=[])
    assert trainer.publisher is None and not trainer.resume()
    await trainer.run(until_version=1)
    assert trainer.version == 1 and (tmp_path / "run" / "checkpoints" / "step_00000001" / "state.json").is_file()
    # the same loop over the megatron backend, its checkpoint included (and resumed)
    cfg.train.backend = "megatron"
    cfg.run.name = "mega"
    trainer = build_trainer(cfg, InMemorySource(make_trajectories(4)), engine_urls=[])
    assert type(trainer.backend).__name__ == "MegatronBackend"
    await trainer.run(until_version=1)
    step = tmp_path / "mega" / "checkpoints" / "step_00000001"
    assert (step / "model" / "model.safetensors").is_file() and (step / "model" / "megatron.json").is_file()
    again = build_trainer(cfg, InMemorySource(), engine_urls=[])
    assert again.resume() and again.version == 1
    for (n, p), (_, q) in zip(trainer.backend.named_weights(), again.backend.named_weights(), strict=True):
        assert torch.equal(p, q), n


async def test_loop_waits_for_data_and_trains_it_when_it_arrives(tiny_model_dir: Path) -> None:
    import asyncio

    source = InMemorySource()
    trainer, records, _ = make(tiny_model_dir, source, batch_timeout_s=0.05)
    run = asyncio.ensure_future(trainer.run(until_version=1))
    # bounded wait on a condition: the loop has asked for data and found none at least once
    for _ in range(2000):
        if trainer.counters["empty_batches"] >= 1:
            break
        await asyncio.sleep(0.005)
    assert trainer.counters["empty_batches"] >= 1 and trainer.version == 0
    source.add(make_trajectories(4))
    await asyncio.wait_for(run, timeout=120)
    assert trainer.version == 1 and records[0].trajectories == 4


class MemorySink(RecordingSink):
    """Also records the release/restore calls of engines that share the trainer's GPUs."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    async def release_memory(self) -> list[str]:
        self.calls.append("release")
        return ["x"]

    async def restore_memory(self, weights: NamedWeights, version: int) -> PublishReport:
        self.calls.append(f"restore {version}")
        return await self.publish(weights, version)


@pytest.mark.parametrize("fail", [False, True])
async def test_engines_give_their_memory_back_around_the_gpu_work(
    tiny_model_dir: Path, fail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release before the first forward, restore with the version reached after the step, also when it fails.
    (One step per batch: the proximal logprobs come from the training forward, so no `logprobs` pass.)"""
    calls: list[str] = []
    trainer, _, _ = make(tiny_model_dir, InMemorySource(make_trajectories(4)))
    sink = MemorySink(calls)
    trainer.publisher, trainer.release_memory = sink, True
    original_logprobs, original_step = trainer.backend.logprobs, trainer.backend.train_step

    def logprobs(*args: object, **kw: object) -> object:
        calls.append("logprobs")
        return original_logprobs(*args, **kw)

    def train_step(*args: object, **kw: object) -> object:
        calls.append("train_step")
        if fail:
            raise RuntimeError("boom")
        return original_step(*args, **kw)

    monkeypatch.setattr(trainer.backend, "logprobs", logprobs)
    monkeypatch.setattr(trainer.backend, "train_step", train_step)
    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            await trainer.step()
        assert calls == ["release", "train_step", "restore 0"]
    else:
        record = await trainer.step()
        assert record is not None and record.version == 1 and record.publish is not None
        assert calls == ["release", "train_step", "restore 1"]
        assert record.times["memory_s"] >= 0 and sum(record.times.values()) <= record.seconds
        assert sink.published == [(1, len(list(trainer.backend.named_weights())))]  # one push, not two


async def test_time_limit_ends_training_like_the_last_step(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    import time as real_time
    import types

    import slime_async.train.loop as loop_module

    ticks = iter(range(0, 10_000, 10))  # a clock that moves 10 s each time the loop reads it
    clock = types.SimpleNamespace(monotonic=lambda: float(next(ticks)), perf_counter=real_time.perf_counter)
    monkeypatch.setattr(loop_module, "time", clock)
    source = InMemorySource(make_trajectories(40))
    trainer, records, _ = make(tiny_model_dir, source, time_limit_s=25.0)
    await trainer.run(until_version=10)
    assert trainer.version == 2 and [r.version for r in records] == [1, 2]  # checks at 10 s, 20 s; 30 s stops


async def test_the_envs_failures_by_name_reach_the_trainers_counters(tiny_model_dir: Path) -> None:
    """A reward that raised or a tool that failed is in metrics.jsonl's counters (and TensorBoard)."""
    trajectories = make_trajectories(4)
    for i, t in enumerate(trajectories):
        t.metrics = {**t.metrics, "reward_errors": 1.0, "reward_errors/exact": 1.0, "tool_errors/convert": float(i),
                     "tool_calls": 3.0}
    trainer, records, _ = make(tiny_model_dir, InMemorySource(trajectories))
    await trainer.run(until_version=1)
    assert len(records) == 1
    assert trainer.counters["reward_errors/exact"] == 4 and trainer.counters["tool_errors/convert"] == 0 + 1 + 2 + 3
    assert "tool_calls" not in trainer.counters and "reward_errors" not in trainer.counters  # names only
