"""Rollout → transport → buffer → trainer client, every hop real: engine and buffer are processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from buffer_procs import start_server
from transformers import AutoTokenizer

from slime_async.buffer import BufferClient, ServerSettings
from slime_async.config.schema import BufferConfig
from slime_async.env import EnvFactory, Limits, Sampling
from slime_async.launch.process import start_engine
from slime_async.rollout import BufferSink, Scheduler, SGLangClient
from slime_async.transport import AsyncSender


async def test_scheduler_streams_groups_to_the_trainer(varied_model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(varied_model_dir, "--max-batch-size", "16")
    settings = ServerSettings(buffer=BufferConfig(endpoint="tcp://127.0.0.1:0"), group_size=4, max_staleness=2,
                              wal_dir=str(tmp_path / "wal"))
    buffer, endpoint = start_server(settings)
    try:
        factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {})
        async with SGLangClient([engine.url]) as client, AsyncSender(endpoint, name="worker-0") as sender:
            sink = BufferSink(sender)
            scheduler = Scheduler(factory, factory.tasks("train"), client, AutoTokenizer.from_pretrained(
                varied_model_dir), sink, group_size=4, batch_size=8, max_staleness=2,
                sampling=Sampling(max_new_tokens=8), limits=Limits(max_turns=2), filter_equal_rewards=False)
            stats = await scheduler.run(num_groups=3)
            await sink.close()
        assert stats.sent == 12 and sender.stats.acked == 12
        trainer = BufferClient(endpoint)
        batch = await asyncio.to_thread(trainer.get_batch, 12, 30.0)
        got = {t.id for g in batch.groups for t in g.trajectories}
        assert len(batch.groups) == 3 and all(len(g.trajectories) == 4 for g in batch.groups)
        assert len(got) == 12
        metrics = await asyncio.to_thread(trainer.metrics)
        assert metrics["received"] == 12
        trainer.close()
    finally:
        buffer.stop()
        engine.stop()
