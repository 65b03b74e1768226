"""The staleness admission rule, in isolation: never over the bound, whatever the completion order."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_async.rollout.admission import StalenessBudget


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 8),
    eta=st.integers(0, 4),
    ops=st.lists(st.tuples(st.sampled_from(["start", "finish", "version"]), st.booleans(), st.integers(0, 50)),
                 max_size=200),
)
def test_admission_never_exceeds_the_bound(batch: int, eta: int, ops: list[tuple[str, bool, int]]) -> None:
    async def scenario() -> None:
        budget = StalenessBudget(batch, eta)
        for op, kept, _ in ops:
            if op == "start" and budget.can_start():
                await budget.acquire()
            elif op == "finish" and budget.running:
                await budget.release(kept)  # any running one: completion order is free
            elif op == "version":
                await budget.set_version(budget.version + 1)
            assert budget.accepted + budget.running <= (budget.version + eta + 1) * batch
            # what was accepted can be trained within eta versions of the current one
            assert budget.accepted <= (budget.version + eta + 1) * batch

    asyncio.run(scenario())


async def test_eta_zero_is_synchronous() -> None:
    budget = StalenessBudget(batch_size=2, max_staleness=0)
    await budget.acquire()
    await budget.acquire()
    third = asyncio.ensure_future(budget.acquire())
    for _ in range(5):
        await asyncio.sleep(0)  # let it run as far as it can: it must be parked on the condition
    assert not third.done() and budget.waits == 1
    await budget.release(kept=True)
    await budget.release(kept=False)  # a filtered one frees its slot...
    await asyncio.wait_for(third, 5)  # ...so the third may start
    fourth = asyncio.ensure_future(budget.acquire())
    await budget.release(kept=True)  # two accepted now: the version-0 batch is full
    for _ in range(5):
        await asyncio.sleep(0)
    assert not fourth.done()
    await budget.set_version(1)  # the trainer consumed the batch
    await asyncio.wait_for(fourth, 5)
    assert budget.running == 1 and budget.accepted == 2


async def test_resume_restores_the_count() -> None:
    budget = StalenessBudget(batch_size=4, max_staleness=1, version=3, accepted=16)
    assert budget.capacity == 20 and budget.can_start()
    for _ in range(4):
        await budget.acquire()
    assert not budget.can_start()


def test_bad_arguments_and_unmatched_release() -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        StalenessBudget(0, 1)
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        asyncio.run(StalenessBudget(1, 0).release(True))


async def test_engines_going_back_recount_what_was_accepted() -> None:
    # A trainer restarted from its checkpoint at 5 after reaching 10: the budget follows the engines
    # back, with what the buffer says was accepted (trained by the checkpoint, or still to train).
    budget = StalenessBudget(batch_size=4, max_staleness=1, version=10, accepted=44)
    await budget.recover(5, accepted=44)  # it got back everything after 5: wait until it is trained
    assert budget.capacity == 28 and not budget.can_start()
    await budget.recover(5, accepted=20)  # nothing came back (no checkpoint held it): room at once
    assert budget.can_start()
    await budget.set_version(4)  # an answer of an engine behind the others also moves it
    assert budget.version == 4
