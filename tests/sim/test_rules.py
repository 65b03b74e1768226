"""The real rules hold inside the simulation: the staleness bound, lockstep at eta 0, the books balance."""

import pytest

from slime_async.rollout.admission import StalenessBudget
from slime_async.sim import Cluster, DecodeCost, IngestCost, Lengths, Plan, SyncCost, TrainerCost, Workload, simulate

DECODE = DecodeCost(((1, 400.0), (8, 1600.0), (64, 5000.0)), max_batch=64)
TAIL = Workload(prompt_tokens=20, completion_tokens=Lengths(15, 0.5, 48), tool_calls_mean=1.5,
                tool_latency_s=Lengths.from_p99(0.5, 10), tool_response_tokens=18, success_p=0.8)


def _run(eta: int, engines: int = 2, policy: str = "fifo") -> object:
    cluster = Cluster(engines, DECODE, TrainerCost(0.3, 1e5), SyncCost(0.05, 0, 0, 0.001), IngestCost(1e-4, 1e-4))
    return simulate(cluster, Plan(32, 8, eta, 30, policy=policy), TAIL, seed=3)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_trained_staleness_never_exceeds_eta_and_books_balance(eta: int) -> None:
    r = _run(eta)
    assert r.max_staleness <= eta
    assert max(r.train_staleness) <= eta
    assert r.steps == 30
    b = r.buffer
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"]
    assert r.episodes >= b["received"] + r.filtered  # the rest are still running at the last step
    if eta > 0:
        assert r.max_staleness == eta  # a long tail reaches the bound


def test_async_beats_lockstep_under_a_latency_tail() -> None:
    assert _run(0).wall_s > 1.5 * _run(3).wall_s


def test_freshest_policy_runs() -> None:
    assert _run(2, policy="freshest").max_staleness <= 2


def test_budget_try_start_and_finish_are_the_rule() -> None:
    b = StalenessBudget(batch_size=2, max_staleness=0)
    assert b.try_start() and b.try_start()
    assert not b.try_start()
    b.finish(kept=False)  # a filtered trajectory frees its slot
    assert b.try_start()
    with pytest.raises(RuntimeError):
        StalenessBudget(2, 0).finish(kept=True)


def test_bad_plan_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"Plan\.steps"):
        Plan(32, 8, 2, 0)
    with pytest.raises(ValueError, match=r"Cluster\.num_engines"):
        Cluster(0, DECODE, TrainerCost(1, 1), SyncCost(0, 0, 0, 0), IngestCost(0))
