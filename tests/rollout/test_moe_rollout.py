"""Routing replay from end to end: a real engine on the tiny MoE records its experts, the scheduler's
episodes keep them on their turns, batches carry them, and the trainer's forward lines up with them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import routing_agreement
from transformers import AutoConfig, AutoTokenizer

from slime_async.env import EnvFactory, Limits, Sampling
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.moe.shape import moe_shape
from slime_async.rollout import ListSink, Scheduler, SGLangClient
from slime_async.train.batch import build_batch
from slime_async.train.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def engine(tiny_moe_dir: Path) -> Iterator[EngineProcess]:
    proc = start_engine(tiny_moe_dir, "--max-batch-size", "16", "--context-length", "1024")
    yield proc
    proc.stop()


async def test_multi_turn_records_line_up_with_the_trainers_own_routing(engine: EngineProcess, tiny_moe_dir: Path
                                                                       ) -> None:
    shape = moe_shape(AutoConfig.from_pretrained(tiny_moe_dir))
    assert shape is not None
    # the guessing game answers every reply (a number or not), and a third of the vocabulary ends a reply:
    # several short turns per episode whatever the random model says, so records are stitched across turns
    factory = EnvFactory.from_config("envs.guess_number:GuessNumberEnv", {})
    sink = ListSink()
    async with SGLangClient([engine.url]) as client:
        scheduler = Scheduler(factory, factory.tasks("train"), client, AutoTokenizer.from_pretrained(tiny_moe_dir),
                              sink, group_size=2, batch_size=4, max_concurrency=4, filter_equal_rewards=False,
                              sampling=Sampling(temperature=1.0, max_new_tokens=10,
                                                stop_token_ids=list(range(0, 880, 3))),
                              limits=Limits(max_turns=3),
                              replay=shape)
        stats = await scheduler.run(num_groups=2)
    trajectories = [t for g in sink.groups for t in g]
    assert stats.balanced() and len(trajectories) == 4
    assert max(len(t.turns) for t in trajectories) > 1
    for t in trajectories:
        assert all(turn.routed_experts is not None and turn.routed_experts.dtype == np.uint8 for turn in t.turns)

    built = build_batch(trajectories, max_seq_len=1024, route_width=shape.route_width)
    batch = built.batch
    assert batch is not None and batch.routed_experts is not None and built.unrouted == 0
    lengths = batch.attention_mask.sum(1)
    for row, n in enumerate(lengths.tolist()):  # every fed position reported; the final token never fed
        assert (batch.routed_experts[row, : n - 1] >= 0).all() and (batch.routed_experts[row, n - 1 :] == -1).all()

    # the trainer's own routing of the whole sequences (transformers' routers, hooked) is the engine's
    # record: same weights, fp32; only near-ties could flip an expert
    agree = routing_agreement(tiny_moe_dir, batch, shape.num_layers, shape.top_k)
    assert agree > 0.99, f"only {agree:.1%} of positions routed alike: the record is misaligned"

    # replayed, the trainer's logprobs are the engine's
    be = TorchBackend(tiny_moe_dir, device="cpu")
    mine = be.logprobs(batch, 1.0).logprobs
    trained = batch.loss_mask > 0
    assert (mine - batch.behaviour_logprobs)[trained].abs().max() < 1e-3
