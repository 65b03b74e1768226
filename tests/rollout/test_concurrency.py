"""Adaptive concurrency: the rule alone, the gate, and the whole loop against real engine processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime_async.env import EnvFactory, Limits, Sampling
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.rollout import ListSink, Scheduler, SGLangClient
from slime_async.rollout.client import EngineLoad
from slime_async.rollout.concurrency import AdaptiveLimit, ConcurrencyGate


def load(running: int, waiting: int, capacity: int | None = None) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, engines=1, capacity=capacity)


def test_slow_start_doubles_while_nothing_waits_and_the_limit_binds() -> None:
    rule = AdaptiveLimit(floor=4, ceiling=100)
    assert rule.limit == 8
    assert [rule.update(load(n, 0), in_flight=n) for n in (8, 16, 32, 64)] == [16, 32, 64, 100]


def test_a_queue_shrinks_the_limit_by_a_quarter_and_ends_slow_start() -> None:
    rule = AdaptiveLimit(floor=4, ceiling=256, start=64)
    assert rule.update(load(running=32, waiting=5), in_flight=64) == 48  # 5 > 32 // 8
    assert not rule.slow_start
    assert rule.update(load(running=32, waiting=0), in_flight=48) == 54  # an eighth now, not double


def test_a_short_queue_or_an_unused_limit_holds_it() -> None:
    rule = AdaptiveLimit(floor=4, ceiling=256, start=40)
    assert rule.update(load(running=32, waiting=4), in_flight=40) == 40  # within the slack (32 // 8)
    assert rule.update(load(running=10, waiting=0), in_flight=12) == 40  # the staleness budget binds, not we
    assert rule.update(None, in_flight=40) == 40  # no engine answered
    assert rule.history == [(32, 4, 40), (10, 0, 40)]


def test_with_the_engines_slots_known_a_queue_beside_free_slots_grows_the_limit() -> None:
    rule = AdaptiveLimit(floor=8, ceiling=512, start=16)
    assert rule.update(load(running=10, waiting=6, capacity=128), in_flight=16) == 128  # slow start: to the slots
    # slots free (the engine queues what it has room for: prefill budget): more episodes, not fewer
    rule.slow_start = False
    assert rule.update(load(running=90, waiting=30, capacity=128), in_flight=128) == 144
    # slots full to within the slack, and a queue: saturated
    assert rule.update(load(running=125, waiting=30, capacity=128), in_flight=144) == 108
    assert rule.update(load(running=125, waiting=3, capacity=128), in_flight=108) == 108  # within the slack


def test_the_limit_stays_between_floor_and_ceiling() -> None:
    rule = AdaptiveLimit(floor=8, ceiling=20, start=10)
    for _ in range(10):
        rule.update(load(running=100, waiting=100), in_flight=rule.limit)
    assert rule.limit == 8
    for _ in range(10):
        rule.update(load(running=1, waiting=0), in_flight=rule.limit)
    assert rule.limit == 20
    with pytest.raises(ValueError, match="floor"):
        AdaptiveLimit(floor=0, ceiling=4)


async def test_the_gate_admits_up_to_its_limit_and_a_resize_wakes_waiters() -> None:
    gate = ConcurrencyGate(2)
    await gate.acquire()
    await gate.acquire()
    third = asyncio.ensure_future(gate.acquire())
    await asyncio.sleep(0)
    assert not third.done() and gate.in_flight == 2
    gate.resize(3)
    await asyncio.wait_for(third, 5)
    assert gate.in_flight == 3
    gate.resize(1)  # shrinking cancels nobody: it holds new ones back until enough ended
    fourth = asyncio.ensure_future(gate.acquire())
    for _ in range(2):
        gate.release()
        await asyncio.sleep(0)
        assert not fourth.done()
    gate.release()
    await asyncio.wait_for(fourth, 5)
    assert gate.in_flight == 1
    gate.release()
    with pytest.raises(RuntimeError, match="without a matching"):
        gate.release()


@pytest.fixture(scope="module")
def small_engine(varied_model_dir: Path):
    # four batch slots: episodes whose tool takes a while must outnumber the slots to keep them busy
    proc = start_engine(varied_model_dir, "--max-batch-size", "4", "--context-length", "1024")
    yield proc
    proc.stop()


async def test_the_engines_load_is_sglangs_v1_loads_summed_over_engines(small_engine: EngineProcess,
                                                                      engines: list[EngineProcess]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(small_engine.url + "/v1/loads?include=core") as r:
        body = await r.json()
    assert r.status == 200 and len(body["loads"]) == 1
    assert body["loads"][0] | {"timestamp": 0} == {
        "timestamp": 0, "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
        "num_total_tokens": 0, "max_total_num_tokens": 4 * 1024, "max_running_requests": 4, "token_usage": 0.0}
    async with SGLangClient([small_engine.url, *(e.url for e in engines)]) as client:
        assert await client.load() == EngineLoad(running=0, waiting=0, engines=3, capacity=4 + 16 + 16)
        client.servers[small_engine.url].healthy = False  # an unhealthy engine is not asked
        assert (await client.load()).engines == 2
    async with SGLangClient(["http://127.0.0.1:9"]) as client:  # nothing answers: None, not an error
        assert await client.load() is None


async def run_adaptive(urls: list[str], tokenizer_dir: Path, groups: int) -> Scheduler:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {})
    async with SGLangClient(urls) as client:
        scheduler = Scheduler(factory, factory.tasks("train"), client, tokenizer, ListSink(), group_size=4,
                              batch_size=8, max_staleness=1 << 20, max_concurrency=64, adaptive_concurrency=True,
                              sampling=Sampling(temperature=1.0, max_new_tokens=24), limits=Limits(max_turns=2),
                              filter_equal_rewards=False)
        assert scheduler.concurrency()["limit"] == 8  # twice the floor (a group) to start
        stats = await asyncio.wait_for(scheduler.run(num_groups=groups), 300)
    assert stats.balanced() and stats.sent == 4 * groups
    assert scheduler.adaptive is not None and scheduler.concurrency()["recent"]
    assert all(4 <= n <= 64 for _, _, n in scheduler.adaptive.history)
    return scheduler


async def test_engines_with_free_slots_draw_more_episodes(engines: list[EngineProcess], varied_model_dir: Path) -> None:
    # two engines of 16 slots: 8 episodes in flight leave most slots empty and nothing waits
    scheduler = await run_adaptive([e.url for e in engines], varied_model_dir, groups=40)
    assert max(n for _, _, n in scheduler.adaptive.history) >= 16


async def test_an_engine_with_a_queue_gets_fewer_episodes(small_engine: EngineProcess, varied_model_dir: Path) -> None:
    # four slots: of 8 or more episodes in flight, about half wait for one (more than the slack of 1), and
    # the limit comes down; it may first have grown where a sample fell between turns (nothing waiting),
    # so what is asserted is that it shrinks, and only on samples of a full engine with a queue
    scheduler = await run_adaptive([small_engine.url], varied_model_dir, groups=24)
    history = scheduler.adaptive.history
    limits = [8] + [n for _, _, n in history]  # the starting limit, then each update's
    shrinks = [(running, waiting) for before, (running, waiting, after) in zip(limits, history, strict=False)
               if after < before]
    assert shrinks, history
    assert all(waiting > max(1, running // 8) and running >= 4 - max(1, running // 8) for running, waiting in shrinks)
