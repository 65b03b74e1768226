"""The processor-sharing engine: requests end when their tokens are served at the batch's rate."""

import pytest

from slime_async.sim.costs import DecodeCost
from slime_async.sim.engines import Engine


def test_two_requests_share_the_rate_then_the_survivor_speeds_up() -> None:
    e = Engine(0, [0.0, 100.0, 60.0])  # 100 tok/s alone, 60 each when two run
    e.submit(0.0, 60.0, "a")
    e.submit(0.0, 120.0, "b")
    assert e.next_end() == pytest.approx(1.0)  # 60 tokens at 60 tok/s
    done, _ = e.pop_finished(1.0)
    assert done == ["a"]
    assert e.next_end() == pytest.approx(1.6)  # 60 left at 100 tok/s


def test_requests_past_max_batch_wait_in_order() -> None:
    e = Engine(0, [0.0, 10.0])
    assert e.submit(0.0, 10.0, "a")
    assert not e.submit(0.0, 10.0, "b")
    done, started = e.pop_finished(1.0)
    assert (done, started) == (["a"], ["b"])
    assert e.next_end() == pytest.approx(2.0)


def test_paused_engine_serves_nothing() -> None:
    e = Engine(0, [0.0, 10.0])
    e.submit(0.0, 10.0, "a")
    e.speed = 0.0
    assert e.next_end() is None
    e.advance(5.0)
    assert e.served == 0.0


def test_decode_cost_interpolates_step_time_and_rejects_bad_points() -> None:
    d = DecodeCost(((1, 100.0), (4, 200.0)), max_batch=8)
    assert d.tokens_per_s(1) == pytest.approx(100.0)
    assert d.tokens_per_s(4) == pytest.approx(200.0)
    assert 200.0 < d.tokens_per_s(8) < 400.0  # step time keeps growing past the last point
    with pytest.raises(ValueError, match=r"DecodeCost\.points"):
        DecodeCost(((1, 0.0),), max_batch=1)
