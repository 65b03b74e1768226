"""Every Struct of `types` through msgpack and JSON, and the frames a reader must refuse."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from slime_async.types import (
    SCHEMA_VERSION,
    DecodeError,
    Group,
    Message,
    SchemaVersionError,
    StopReason,
    Task,
    ToolCall,
    Trajectory,
    Turn,
    from_json,
    from_msgpack,
    new_id,
    to_json,
    to_msgpack,
)


def make_turn(n_prompt: int = 5, n_completion: int = 7, version: int = 3) -> Turn:
    rng = np.random.default_rng(n_prompt * 100 + n_completion)
    return Turn(
        prompt_ids=rng.integers(0, 150_000, n_prompt),
        completion_ids=rng.integers(0, 150_000, n_completion),
        logprobs=-rng.random(n_completion),
        versions=np.arange(n_completion) // 3 + version,
        loss_mask=rng.integers(0, 2, n_completion),
        finish_reason="stop",
    )


def make_trajectory(sample_index: int = 0) -> Trajectory:
    return Trajectory(
        task_id="task-1",
        group_id="group-1",
        sample_index=sample_index,
        turns=[make_turn(12, 9, 3), make_turn(4, 6, 5), make_turn(3, 0, 6)],
        stop_reason=StopReason.MAX_TURNS,
        rewards={"correct": 1.0, "format": 0.5},
        reward=1.25,
        metrics={"tool_calls": 2.0},
        timings={"generate": 0.5, "tools": 0.01},
        env="envs.calculator:CalculatorEnv",
    )


EXAMPLES = [
    Task(id="t1", prompt="What is 2 + 3?", answer=5, metadata={"split": "train", "difficulty": [1, 2]}),
    Task(
        id="t2",
        prompt=[Message(role="system", content="be brief"), Message(role="user", content="hi")],
        answer={"x": [1, "two"]},
    ),
    Message(
        role="assistant",
        content="calling",
        tool_calls=[ToolCall(name="calculate", arguments={"expression": "2 + 3", "exact": True})],
    ),
    Message(role="tool", content="5", tool_call_id="call_1", name="calculate"),
    ToolCall(name="search", arguments={"query": "x", "k": 3}),
    make_turn(),
    make_trajectory(),
    Group(group_id="group-1", task_id="task-1", trajectories=[make_trajectory(i) for i in range(3)]),
]


def assert_same(a: object, b: object) -> None:
    """Structs with arrays compare by their builtins form (numpy arrays have no plain ==)."""
    enc = msgspec.json.Encoder(enc_hook=lambda o: o.tolist() if isinstance(o, np.ndarray) else o)
    assert type(a) is type(b)
    assert enc.encode(a) == enc.encode(b)


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_msgpack_round_trip(obj: msgspec.Struct) -> None:
    frame = to_msgpack(obj)
    back = from_msgpack(frame, type(obj))
    assert_same(obj, back)
    assert to_msgpack(back) == frame  # encoding is deterministic and lossless


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_json_round_trip(obj: msgspec.Struct) -> None:
    back = from_json(to_json(obj), type(obj))
    assert_same(obj, back)


def test_arrays_travel_as_raw_bytes_of_the_right_dtype() -> None:
    turn = make_turn(n_prompt=1000, n_completion=1000)
    frame = to_msgpack(turn)
    # 4 bytes per id (prompt and completion), logprob and version, 1 per mask value, plus a small fixed overhead
    assert 17_000 <= len(frame) < 17_200
    assert turn.prompt_ids.tobytes() in frame
    back = from_msgpack(frame, Turn)
    assert back.completion_ids.dtype == np.dtype("<i4")
    assert back.logprobs.dtype == np.dtype("<f4")
    assert back.loss_mask is not None and back.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(back.logprobs, turn.logprobs)


def test_decoded_arrays_are_read_only_views_of_the_frame() -> None:
    # Zero-copy decode: the buffer server keeps frames, and a copy per array would double its memory.
    frame = to_msgpack(make_turn(n_prompt=100, n_completion=100))
    back = from_msgpack(frame, Turn)
    for arr in (back.prompt_ids, back.completion_ids, back.logprobs, back.versions):
        assert np.shares_memory(arr, np.frombuffer(frame, np.uint8)), arr
        assert not arr.flags.writeable


def test_lists_become_arrays_and_mask_defaults_to_ones() -> None:
    turn = Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[-0.5, -1.0, 0.0], versions=[0, 0, 1])
    assert turn.completion_ids.dtype == np.dtype("<i4")
    assert turn.loss_mask is not None and turn.loss_mask.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": [-1.0]}, "logprobs has 1 entries but completion_ids has 3"),
        ({"versions": [0, 0]}, "versions has 2 entries but completion_ids has 3"),
        ({"loss_mask": [1, 1, 1, 1]}, "loss_mask has 4 entries"),
        ({"completion_ids": [1.5, 2.0, 3.0]}, "completion_ids: expected integers"),
        ({"completion_ids": [1, 2, 2**40]}, "completion_ids: values outside the range"),
        ({"completion_ids": [[1], [2], [3]]}, "completion_ids: expected a 1-D array"),
    ],
)
def test_turn_rejects_inconsistent_arrays(kwargs: dict, message: str) -> None:
    fields = {"prompt_ids": [1], "completion_ids": [1, 2, 3], "logprobs": [0.0] * 3, "versions": [0] * 3}
    with pytest.raises(ValueError, match=message):
        Turn(**{**fields, **kwargs})


def test_decoding_checks_array_lengths_too() -> None:
    """A frame whose arrays disagree is refused at decode, with the field path."""
    good = make_turn(2, 3)
    raw = msgspec.msgpack.decode(to_msgpack(good))
    raw["logprobs"] = msgspec.msgpack.Ext(2, np.zeros(2, "<f4").tobytes())
    with pytest.raises(DecodeError, match="logprobs has 2 entries but completion_ids has 3"):
        from_msgpack(msgspec.msgpack.encode(raw), Turn)


def test_newer_schema_version_is_rejected_before_the_body() -> None:
    traj = make_trajectory()
    traj.schema_version = SCHEMA_VERSION + 1
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}, newer than"):
        from_msgpack(to_msgpack(traj), Trajectory)
    with pytest.raises(SchemaVersionError):
        from_json(to_json(traj), Trajectory)
    # a newer frame is refused even when its body would not even parse as today's schema
    raw = msgspec.msgpack.decode(to_msgpack(make_trajectory()))
    raw.update(schema_version=SCHEMA_VERSION + 1, turns="a field that changed type")
    with pytest.raises(SchemaVersionError):
        from_msgpack(msgspec.msgpack.encode(raw), Trajectory)


def test_older_and_current_schema_versions_are_read() -> None:
    raw = msgspec.msgpack.decode(to_msgpack(make_trajectory()))
    raw["schema_version"] = 0
    assert from_msgpack(msgspec.msgpack.encode(raw), Trajectory).schema_version == 0


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\xc1garbage", "invalid Trajectory frame"),
        (b"", "invalid Trajectory frame"),
        (to_msgpack(make_trajectory())[:-10], "invalid Trajectory frame"),
        (msgspec.msgpack.encode({"task_id": "x"}), "missing required field"),
        (msgspec.msgpack.encode({**msgspec.to_builtins(Task(id="a", prompt="b"))}), "missing required field"),
    ],
)
def test_bad_frames_raise_decode_error(frame: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        from_msgpack(frame, Trajectory)


def test_unknown_array_extension_is_rejected() -> None:
    raw = msgspec.msgpack.decode(to_msgpack(make_turn(2, 3)))
    raw["prompt_ids"] = msgspec.msgpack.Ext(99, b"\0" * 8)
    with pytest.raises(DecodeError, match="unknown array extension code 99"):
        from_msgpack(msgspec.msgpack.encode(raw), Turn)


def test_stop_reason_and_tool_call_ids() -> None:
    assert {r.value for r in StopReason} >= {"done", "max_turns", "parse_error", "server_error", "aborted"}
    assert ToolCall(name="a").id != ToolCall(name="a").id
    assert make_trajectory().id != make_trajectory().id


def test_new_id_is_32_hex_digits_and_fresh_each_time() -> None:
    ids = [new_id() for _ in range(10_000)]
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)
    assert len(set(ids)) == len(ids)


def test_trajectory_helpers() -> None:
    traj = make_trajectory()
    ids, logprobs, mask = traj.flat()
    assert len(ids) == len(logprobs) == len(mask) == traj.num_tokens == 12 + 9 + 4 + 6 + 3
    assert traj.num_completion_tokens == 15
    # prompt tokens are never trained on and carry no behaviour logprob
    assert mask[:12].sum() == 0 and np.all(logprobs[:12] == 0)
    np.testing.assert_array_equal(ids[12:21], traj.turns[0].completion_ids)
    assert traj.min_version() == 3
    assert traj.staleness(trainer_version=7) == 4
    empty = Trajectory(task_id="t", group_id="g", sample_index=0, turns=[], stop_reason=StopReason.ENV_ERROR)
    assert empty.min_version() is None and empty.staleness(5) == 0 and len(empty.flat()[0]) == 0


def test_message_to_chat_matches_openai_shape() -> None:
    msg = Message(role="assistant", content="", tool_calls=[ToolCall(id="c1", name="f", arguments={"a": 1})])
    assert msg.to_chat() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
    }
