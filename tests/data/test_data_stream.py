"""Order, epochs and resuming of a task stream; building it from the config's `data:` section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_async.config import ConfigError, load_config
from slime_async.data import (
    DataState,
    EnvRouter,
    IterableSource,
    JsonlSource,
    RowFormat,
    TaskStream,
    UnknownEnv,
    build_envs,
    build_tasks,
    load_state,
    save_state,
)
from slime_async.env import EnvFactory
from slime_async.types import Task

ROWS = [{"prompt": f"p{i}", "label": i} for i in range(10)]


def ids(stream: TaskStream, n: int) -> list[int]:
    return [next(stream).answer for _ in range(n)]


def test_shuffle_is_a_seeded_permutation_per_epoch() -> None:
    order = ids(TaskStream(IterableSource(ROWS), shuffle=True, seed=3, epochs=2), 20)
    assert sorted(order[:10]) == sorted(order[10:]) == list(range(10))  # each epoch sees every row once
    assert order[:10] != list(range(10)) and order[:10] != order[10:]  # shuffled, differently each epoch
    assert order == ids(TaskStream(IterableSource(ROWS), shuffle=True, seed=3, epochs=2), 20)
    assert order != ids(TaskStream(IterableSource(ROWS), shuffle=True, seed=4, epochs=2), 20)


def test_epochs_end_the_stream_and_none_cycles_for_ever() -> None:
    assert len(list(TaskStream(IterableSource(ROWS), epochs=3))) == 30
    endless = TaskStream(IterableSource(ROWS), epochs=None)
    assert len(ids(endless, 55)) == 55 and endless.state().epoch == 5


@pytest.mark.parametrize("stop_at", [0, 7, 10, 13, 25])
def test_resuming_from_a_saved_state_continues_exactly(tmp_path: Path, stop_at: int) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:5]) + "{bad\n" + "".join(
        json.dumps(r) + "\n" for r in ROWS[5:]))

    def stream(state: DataState | None = None) -> TaskStream:
        return TaskStream(JsonlSource(path), shuffle=True, seed=11, epochs=3, state=state)

    whole = [t.id for t in stream()]
    first = stream()
    head = [next(first).id for _ in range(stop_at)]
    save_state(first.state(), tmp_path / "state.json")
    rest = [t.id for t in stream(load_state(tmp_path / "state.json"))]
    assert head + rest == whole and len(whole) == 30
    assert stream(load_state(tmp_path / "state.json")).state() == first.state()


def test_a_damaged_state_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"epoch": -1}')
    with pytest.raises(ValueError, match=r"state\.json"):
        load_state(tmp_path / "state.json")


def test_default_config_takes_tasks_from_the_env_as_before() -> None:
    cfg = load_config("configs/local.yaml")
    envs = build_envs(cfg)
    assert isinstance(envs, EnvFactory)
    stream = build_tasks(cfg, envs)
    expected = list(envs.tasks("train"))[:5]
    assert [next(stream) for _ in range(5)] == expected  # the env's own order, not shuffled


def test_config_builds_a_shuffled_jsonl_stream_with_a_router(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "What is 2+3?", "label": 5, "env": "calc"},
            {"prompt": "Name a colour.", "label": "red", "env": "chat"},
            {"prompt": "x", "label": 1, "env": "nope"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [
        "data.source=jsonl", f"data.path={path}", "data.env_key=env", "data.epochs=1", "data.seed=5",
        "data.envs={calc: {name: 'envs.calculator:CalculatorEnv'}, chat: {name: 'envs.chat:ChatEnv'}}",
    ])
    envs = build_envs(cfg)
    assert isinstance(envs, EnvRouter)
    stream = build_tasks(cfg, envs)
    tasks = list(stream)
    assert sorted(t.metadata["env"] for t in tasks) == ["calc", "chat"]
    assert stream.state().skipped == 1 and "unknown environment 'nope'" in stream.errors[0]
    assert f"{path}:3" in stream.errors[0]
    assert envs.for_task(next(t for t in tasks if t.metadata["env"] == "calc")).name == "envs.calculator:CalculatorEnv"
    with pytest.raises(UnknownEnv, match="names no environment"):
        envs.for_task(Task(id="t", prompt="x"))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="path is required when source is 'jsonl'"):
        load_config(None, ["data.source=jsonl"])
    with pytest.raises(ConfigError, match="default_env 'b' is not one of envs"):
        load_config(None, ["data.envs={a: {name: 'envs.calculator:CalculatorEnv'}}", "data.default_env=b"])
    with pytest.raises(ConfigError, match=r"data.eval\[0\].*pass_k \[4\] needs n_samples >= 4"):
        load_config(None, ["data.eval=[{name: e, pass_k: [4]}]"])


def test_shards_split_each_epoch_between_workers() -> None:
    streams = [TaskStream(IterableSource(ROWS), shuffle=True, seed=2, epochs=2, shard=(i, 3)) for i in range(3)]
    seen = [[t.answer for t in s] for s in streams]
    for epoch in range(2):
        parts = [s[: len(s) // 2] if epoch == 0 else s[len(s) // 2 :] for s in seen]
        assert sorted(x for p in parts for x in p) == list(range(10))  # every row once per epoch, over the shards
    with pytest.raises(ValueError, match="0 <= index < count"):
        TaskStream(IterableSource(ROWS), shard=(3, 3))


def test_a_state_of_another_dataset_or_order_is_refused() -> None:
    state = TaskStream(IterableSource(ROWS, name="a"), shuffle=True, seed=1).state()
    TaskStream(IterableSource(ROWS, name="a"), shuffle=True, seed=1, state=state)  # the same: fine
    for other in (dict(name="b", seed=1), dict(name="a", seed=2)):
        with pytest.raises(ValueError, match="the dataset, seed or shard changed"):
            TaskStream(IterableSource(ROWS, name=other["name"]), shuffle=True, seed=other["seed"], state=state)


def test_rows_without_an_env_value_go_to_the_default_env() -> None:
    router = EnvRouter({"calc": EnvFactory.from_config("envs.calculator:CalculatorEnv"),
                        "chat": EnvFactory.from_config("envs.chat:ChatEnv")}, default="chat")
    rows = [{"prompt": "a", "label": 1, "env": "calc"}, {"prompt": "b", "label": 2},
            {"prompt": "c", "label": 3, "env": 7}]
    stream = TaskStream(IterableSource(rows), RowFormat(env_key="env"), validate=router.check)
    tasks = list(stream)
    assert [router.for_task(t).name for t in tasks] == ["envs.calculator:CalculatorEnv", "envs.chat:ChatEnv"]
    assert stream.state().skipped == 1 and "'env' must be a non-empty string" in stream.errors[0]
