"""Task sources over real files: slime's JSONL rows, HF datasets on disk, Python iterables; bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_async.data import (
    BadRow,
    HFSource,
    IterableSource,
    JsonlSource,
    RowFormat,
    TaskStream,
    TooManyBadRows,
    row_to_task,
)
from slime_async.types import Message, Task


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_slime_rows_become_tasks_with_text_or_chat_prompts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "math.jsonl", [
        {"prompt": "What is 2+3?", "label": "5", "metadata": {"level": 1}},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], "label": 2},
    ])
    tasks = list(TaskStream(JsonlSource(path)))
    assert tasks[0] == Task(id="math:0", prompt="What is 2+3?", answer="5", metadata={"level": 1})
    assert tasks[1].prompt == [Message(role="system", content="Be brief."), Message(role="user", content="1+1?")]
    assert tasks[1].answer == 2 and tasks[1].id == "math:1"


def test_key_names_are_configurable_like_slimes_flags(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Capital of France?", "answer": "Paris", "uid": "q7",
                                                "extra": {"src": "x"}}])
    fmt = RowFormat(input_key="question", label_key="answer", metadata_key="extra", id_key="uid")
    (task,) = TaskStream(JsonlSource(path), fmt)
    assert task == Task(id="q7", prompt="Capital of France?", answer="Paris", metadata={"src": "x"})


@pytest.mark.parametrize(("line", "words"), [
    ('{"prompt": "ok", "label": ', "not valid JSON"),
    ('{"question": "no prompt key", "label": 1}', "missing prompt key 'prompt'"),
    ('{"prompt": "no label"}', "missing label key 'label'"),
    ('{"prompt": [{"role": "wizard", "content": "x"}], "label": 1}', "not a list of chat messages"),
    ('{"prompt": "x", "label": 1, "metadata": [1]}', "'metadata' must be an object"),
    ('[1, 2]', "must be a JSON object"),
])  # fmt: skip
def test_a_bad_line_raises_an_error_naming_file_and_line(tmp_path: Path, line: str, words: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "label": 1}, "", line])
    stream = TaskStream(JsonlSource(path), on_bad_row="raise")
    assert next(stream).prompt == "fine"
    with pytest.raises(BadRow) as err:
        next(stream)
    assert f"{path}:3:" in str(err.value) and words in str(err.value)  # line 3: blank lines keep their number


def test_bad_rows_are_skipped_and_counted_by_default(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "label": 1}, "{oops", {"prompt": "b"},
                                                  {"prompt": "c", "label": 3}])
    stream = TaskStream(JsonlSource(path))
    assert [t.prompt for t in stream] == ["a", "c"]
    assert stream.state().skipped == 2 and stream.state().served == 2
    assert f"{path}:2:" in stream.errors[0] and f"{path}:3:" in stream.errors[1]


def test_max_skipped_stops_the_run_past_the_bound(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ["{x", "{y", {"prompt": "a", "label": 1}])
    stream = TaskStream(JsonlSource(path), max_skipped=1)
    with pytest.raises(TooManyBadRows, match=r"more than data\.max_skipped=1"):
        list(stream)


def test_an_epoch_without_a_good_row_is_an_error_not_an_endless_loop(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "all_bad.jsonl", ["{x", "{y"])
    with pytest.raises(TooManyBadRows, match="epoch 0 had no usable row"):
        next(TaskStream(JsonlSource(path), epochs=None))


def test_missing_file_and_empty_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl does not exist"):
        JsonlSource(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="has no rows"):
        TaskStream(JsonlSource(tmp_path / "empty.jsonl"))


def test_unlabelled_rows_when_label_key_is_null() -> None:
    task = row_to_task({"prompt": "hi"}, RowFormat(label_key=None), "rows[0]", "rows:0")
    assert task.answer is None


def test_hf_dataset_saved_to_disk_and_parquet_file(tmp_path: Path) -> None:
    import datasets

    rows = {"prompt": ["p0", "p1", "p2"], "label": ["0", "1", "2"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "data.parquet"))
    write_jsonl(tmp_path / "data.jsonl", [{"prompt": p, "label": x} for p, x in zip(rows["prompt"], rows["label"],
                                                                                    strict=True)])
    for path in (tmp_path / "saved", tmp_path / "data.parquet", tmp_path / "data.jsonl"):
        tasks = list(TaskStream(HFSource(str(path))))
        assert [(t.prompt, t.answer) for t in tasks] == [("p0", "0"), ("p1", "1"), ("p2", "2")]
    bad = datasets.Dataset.from_dict({"question": ["q"], "label": ["x"]})
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(BadRow, match=r"bad\[train\]\[0\]: missing prompt key"):
        next(TaskStream(HFSource(str(tmp_path / "bad")), on_bad_row="raise"))
    datasets.DatasetDict({"train": bad}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="no split 'test'"):
        HFSource(str(tmp_path / "dict"), split="test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFSource(str(tmp_path / "missing"))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unknown file type '\.txt'"):
        HFSource(str(tmp_path / "data.txt"))


def test_python_iterables_of_rows_or_tasks() -> None:
    gen = ({"prompt": f"p{i}", "label": i} for i in range(3))
    assert [t.answer for t in TaskStream(IterableSource(gen))] == [0, 1, 2]
    ready = [Task(id="a", prompt="x"), Task(id="b", prompt="y")]
    assert list(TaskStream(IterableSource(ready), epochs=2)) == ready + ready
