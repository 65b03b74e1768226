"""The buffer's wire fuzzed over a real socket, a bounded share of `slime-async bench fuzz`'s 100,000."""

from __future__ import annotations

from slime_async.buffer.fuzz import fuzz_wire


def test_hostile_frames_are_answered_counted_and_never_stored_invalid() -> None:
    run = fuzz_wire(6_000, seed=7)
    answered = sum(n for outcome, n in run.answers.items() if outcome != "stored")
    assert answered == 6_000, run.answers  # every frame acked or nacked, none lost in silence
    assert run.alive and run.stored_invalid == 0, run
    assert {"nack invalid", "nack garbage", "nack truncated"} <= set(run.answers), run.answers
    assert run.answers["ack"] > 0 and run.answers["stored"] > 0, run.answers
