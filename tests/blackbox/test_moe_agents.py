"""Black-box agents on an MoE model: every call an agent makes through the endpoint carries the engine's
routing record onto its turns, also across a rewritten history and n samples (new segments)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import routing_agreement
from transformers import AutoConfig, AutoTokenizer

from slime_async.agents import AgentEnv, close_shared_server
from slime_async.env import run_episode
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.moe.routing import SequenceRoutes
from slime_async.moe.shape import moe_shape
from slime_async.rollout import HttpPolicy, SGLangClient
from slime_async.train.batch import build_batch
from slime_async.types import Task


@pytest.fixture(scope="module")
def moe_engine(tiny_moe_dir: Path) -> Iterator[EngineProcess]:
    proc = start_engine(tiny_moe_dir, "--max-batch-size", "16", "--context-length", "1024")
    yield proc
    proc.stop()


@pytest.mark.parametrize("agent", ["rewriting", "two_samples"])
async def test_agent_calls_carry_records_that_line_up_with_the_trainers_routing(
        agent: str, moe_engine: EngineProcess, tiny_moe_dir: Path) -> None:
    shape = moe_shape(AutoConfig.from_pretrained(tiny_moe_dir))
    assert shape is not None
    env = AgentEnv(AgentEnv.Args(agent=f"blackbox_agents:{agent}"))
    try:
        async with SGLangClient([moe_engine.url]) as client:
            policy = HttpPolicy(client, "e", SequenceRoutes(shape.route_width, shape.num_experts))
            traj = await run_episode(env, Task(id="t", prompt="What is 2+3?", metadata={}), policy,
                                     AutoTokenizer.from_pretrained(tiny_moe_dir))
    finally:
        await close_shared_server()
    assert len(traj.turns) == 3 and any(t.new_branch for t in traj.turns[1:])
    assert all(t.routed_experts is not None for t in traj.turns)
    built = build_batch([traj], max_seq_len=1024, route_width=shape.route_width)
    batch = built.batch
    assert batch is not None and batch.routed_experts is not None and built.unrouted == 0 and len(batch) >= 2
    for row, length in enumerate(batch.attention_mask.sum(1).tolist()):
        known, unknown = batch.routed_experts[row, : length - 1], batch.routed_experts[row, length - 1:]
        assert (known >= 0).all() and (unknown == -1).all()
    assert routing_agreement(tiny_moe_dir, batch, shape.num_layers, shape.top_k) > 0.99
