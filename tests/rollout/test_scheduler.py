"""The scheduler against real engine processes with the calculator env: groups, accounting, admission."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime_async.env import EnvFactory, Limits, Sampling
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.rollout import JsonlSink, ListSink, Scheduler, SGLangClient
from slime_async.types import Trajectory, from_json

SAMPLING = Sampling(temperature=1.0, max_new_tokens=12)
LIMITS = Limits(max_turns=2)


@pytest.fixture(scope="module")
def tokenizer(varied_model_dir: Path):
    return AutoTokenizer.from_pretrained(varied_model_dir)


def make(client: SGLangClient, tokenizer, sink, **kw) -> Scheduler:
    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {})
    defaults = dict(group_size=4, batch_size=8, max_staleness=2, max_concurrency=8, sampling=SAMPLING, limits=LIMITS,
                    filter_equal_rewards=False)
    return Scheduler(factory, factory.tasks("train"), client, tokenizer, sink, **{**defaults, **kw})


async def until(predicate, timeout: float = 120.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    pytest.fail("condition never held")


async def test_groups_reach_the_sink_whole_and_accounted(engines: list[EngineProcess], tokenizer) -> None:
    sink = ListSink()
    async with SGLangClient([e.url for e in engines]) as client:
        scheduler = make(client, tokenizer, sink)
        stats = await scheduler.run(num_groups=3)
    assert stats.balanced() and stats.started == stats.sent == 12 and len(sink.groups) == 3
    for group in sink.groups:
        assert len({t.group_id for t in group}) == 1 and len({t.task_id for t in group}) == 1
        assert sorted(t.sample_index for t in group) == [0, 1, 2, 3]
        for t in group:
            assert t.env == "envs.calculator:CalculatorEnv" and t.turns and t.turns[0].completion_ids.size
            assert t.min_version() == 0
    assert sum(stats.stop_reasons.values()) == 12 and stats.staleness == {0: 12}
    assert scheduler.budget.accepted == 12 and scheduler.budget.running == 0


async def test_equal_reward_groups_are_dropped_and_free_their_slots(engines, tokenizer) -> None:
    sink = ListSink()
    async with SGLangClient([engines[0].url]) as client:
        scheduler = make(client, tokenizer, sink, filter_equal_rewards=True, batch_size=4, max_staleness=0)
        # the random model never answers right: every group has equal rewards and is dropped; with
        # eta = 0 and B = 4 the run could not go past one group if dropped slots were not freed
        stats = await scheduler.run(num_groups=3)
    assert sink.groups == [] and stats.dropped == {"equal_rewards": 12} and stats.groups_dropped["equal_rewards"] == 3
    assert stats.balanced() and scheduler.budget.accepted == 0


async def test_a_group_filter_keeps_drops_and_survives_its_own_errors(engines, tokenizer) -> None:
    """`rollout.group_filter` (slime's dynamic sampling filter): True keeps a group, False or a reason
    drops it as `filtered`; one that raises drops the group as `filter_error`. Dropped slots are freed."""
    seen: list[list[Trajectory]] = []

    def every_other(group: list[Trajectory]) -> bool | str:
        seen.append(group)
        if len(seen) % 3 == 0:
            raise RuntimeError("the judge is down")
        return True if len(seen) % 3 == 1 else "too easy"

    sink = ListSink()
    async with SGLangClient([engines[0].url]) as client:
        scheduler = make(client, tokenizer, sink, group_filter=every_other, batch_size=4, max_staleness=4)
        stats = await scheduler.run(num_groups=6)
    assert len(seen) == 6 and all(len(g) == 4 for g in seen)
    assert {g[0].group_id for g in sink.groups} == {seen[0][0].group_id, seen[3][0].group_id}
    assert stats.dropped == {"filtered": 8, "filter_error": 8} and stats.filter_errors == 2
    assert stats.balanced() and scheduler.budget.accepted == 8


async def test_eta_zero_waits_for_the_trainer(engines, tokenizer, tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "out.jsonl")
    async with SGLangClient([engines[1].url]) as client:
        scheduler = make(client, tokenizer, sink, batch_size=4, max_staleness=0)
        run = asyncio.ensure_future(scheduler.run(num_groups=2))
        await until(lambda: scheduler.stats.sent == 4)
        for _ in range(20):
            await asyncio.sleep(0)
        assert scheduler.stats.started == 4 and not run.done()  # the second group waits for version 1
        assert scheduler.budget.waits >= 1
        await scheduler.set_version(1)
        stats = await asyncio.wait_for(run, 120)
    await sink.close()
    assert stats.sent == 8 and stats.balanced()
    lines = (tmp_path / "out.jsonl").read_bytes().splitlines()
    assert len(lines) == 8 and all(isinstance(from_json(line, Trajectory), Trajectory) for line in lines)


async def test_admission_bound_holds_during_a_run(engines, tokenizer) -> None:
    sink = ListSink()
    peaks: list[int] = []
    async with SGLangClient([e.url for e in engines]) as client:
        scheduler = make(client, tokenizer, sink, batch_size=4, max_staleness=1, max_concurrency=16)
        budget = scheduler.budget
        original = budget.acquire

        async def acquire() -> None:
            await original()
            peaks.append(budget.accepted + budget.running - budget.capacity)

        budget.acquire = acquire  # type: ignore[method-assign]
        run = asyncio.ensure_future(scheduler.run(num_groups=4))
        await until(lambda: scheduler.stats.sent >= 8)  # (0 + 1 + 1) * 4: full at version 0
        await scheduler.set_version(1)
        await until(lambda: scheduler.stats.sent >= 12)
        await scheduler.set_version(2)
        stats = await asyncio.wait_for(run, 120)
    assert stats.sent == 16 and max(peaks) <= 0


async def test_an_engine_killed_mid_run_fails_over(varied_model_dir: Path, tokenizer) -> None:
    procs = [start_engine(varied_model_dir, "--max-batch-size", "16") for _ in range(2)]
    sink = ListSink()
    try:
        async with SGLangClient([p.url for p in procs], backoff=0.05, unhealthy_after=1) as client:
            scheduler = make(client, tokenizer, sink, batch_size=32, max_concurrency=8)
            run = asyncio.ensure_future(scheduler.run(num_groups=5))
            await until(lambda: scheduler.stats.started >= 8)
            procs[0].proc.send_signal(signal.SIGKILL)
            stats = await asyncio.wait_for(run, 300)
        assert stats.balanced() and stats.started == 20
        assert stats.sent == 20, stats.dropped  # every episode finished on the surviving engine
        assert client.servers[procs[0].url].healthy is False
    finally:
        for p in procs:
            p.stop()


async def test_stop_while_waiting_for_admission_accounts_for_everything(engines, tokenizer) -> None:
    """Stopped with a group half admitted (the budget is full): it returns, and nothing started is lost."""
    sink = ListSink()
    async with SGLangClient([engines[0].url]) as client:
        scheduler = make(client, tokenizer, sink, group_size=4, batch_size=6, max_staleness=0)
        run = asyncio.ensure_future(scheduler.run(num_groups=3))
        await until(lambda: scheduler.stats.sent == 4 and scheduler.budget.waits >= 1)
        scheduler.stop()  # the second group has 2 episodes admitted and waits for 2 more slots
        stats = await asyncio.wait_for(run, 120)
    assert stats.started == 6 and stats.sent == 4 and stats.dropped == {"aborted": 2}
    assert stats.balanced() and scheduler.budget.running == 0


async def test_blocked_admission_learns_the_new_version_from_the_engines(engines, tokenizer) -> None:
    """Nothing in flight, budget full: the scheduler asks the engines and goes on once they serve v1."""
    from helpers import post

    url = engines[1].url
    sink = ListSink()
    async with SGLangClient([url]) as client:
        scheduler = make(client, tokenizer, sink, batch_size=4, max_staleness=0)
        run = asyncio.ensure_future(scheduler.run(num_groups=2))
        await until(lambda: scheduler.stats.sent == 4 and scheduler.budget.waits >= 1)
        status, _ = await post(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        assert status == 200
        stats = await asyncio.wait_for(run, 120)  # no set_version call: learned from /get_model_info
        assert stats.sent == 8 and scheduler.budget.version == 1
        await post(url, "/update_weight_version", {"new_version": "0", "abort_all_requests": False})
