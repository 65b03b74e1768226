"""The run summary's books: one identity each, printed with the reasons, a mismatch said out loud."""

from __future__ import annotations

from slime_async.launch.train_run import buffer_books, episode_books

BUFFER = {"received": 100, "trained": 60, "buffered": 10, "dropped_total": 30, "dropped_stale": 20,
          "dropped_late": 0, "dropped_ahead": 10}


def test_buffer_books_count_each_drop_once_by_reason() -> None:
    text = buffer_books(BUFFER)
    assert text == "received 100 = trained 60 + buffered 10 + dropped 30 (10 ahead, 20 stale)"
    assert "DOES NOT ADD UP" in buffer_books({**BUFFER, "trained": 61})


def worker(started: int, episodes: int, in_flight: int, sent: int, dropped: dict[str, int], lost: int = 0,
           lives: int = 1) -> dict:
    return {"episodes": episodes, "in_flight": in_flight, "sent": sent, "dropped": dropped,
            "totals": {"started": started, "sent": sent, "dropped": dropped, "lost_in_flight": lost, "lives": lives}}


def test_episode_books_hold_exactly_without_deaths_and_say_so_after_one() -> None:
    clean = worker(130, 128, 2, 100, {"equal_rewards": 28})
    assert episode_books([clean], BUFFER) == ("started 130 = to the buffer 100 + dropped by the rollout 28 "
                                               "(28 equal_rewards) + lost in flight with a dead worker 0 + in flight 2")
    assert "DOES NOT ADD UP" in episode_books([worker(131, 128, 2, 100, {"equal_rewards": 28})], BUFFER)
    restarted = worker(140, 100, 0, 98, {"equal_rewards": 28}, lost=4, lives=2)
    assert "a killed worker's counts are from its last report: -2 between sent and received" in episode_books(
        [restarted], BUFFER)
