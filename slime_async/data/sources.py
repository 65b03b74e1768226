"""Row sources: a JSONL file, a Hugging Face dataset from a local path (or the hub), a Python iterable.

A source is a finite, indexable sequence of raw rows (dicts) that knows the place of each row,
so that shuffling, epochs and resuming from an offset (`stream.TaskStream`) work the same over
all of them, and a bad row's error names its file and line. Rows are parsed when read, not when
the source opens: one bad line costs that line, not the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from slime_async.data.rows import BadRow

_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""`datasets` builder of a local data file, by suffix."""


class RowSource(Protocol):
    name: str
    """Short name used in default task ids (`NAME:INDEX`) and messages."""

    def __len__(self) -> int: ...

    def row(self, index: int) -> tuple[Any, str]:
        """The raw row at `index` and its place ("FILE:LINE"); raises BadRow if it does not parse."""
        ...


class JsonlSource:
    """One JSON object per line. Opening scans the file once for line offsets (blank lines are not
    rows); each row is read and parsed when asked for, so a line that does not parse is a BadRow
    naming `FILE:LINE`."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file {self.path} does not exist (data.path)")
        self.name = name or self.path.stem
        self._offsets: list[int] = []
        self._lines: list[int] = []
        offset = 0
        with self.path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    self._offsets.append(offset)
                    self._lines.append(number)
                offset += len(line)
        self._file = self.path.open("rb")

    def __len__(self) -> int:
        return len(self._offsets)

    def row(self, index: int) -> tuple[Any, str]:
        place = f"{self.path}:{self._lines[index]}"
        self._file.seek(self._offsets[index])
        line = self._file.readline()
        try:
            return msgspec.json.decode(line), place
        except msgspec.DecodeError as exc:
            raise BadRow(place, f"not valid JSON: {exc}") from None

    def close(self) -> None:
        self._file.close()


class HFSource:
    """A Hugging Face `datasets` dataset: a directory written by `save_to_disk`, a data file
    (.jsonl/.json/.parquet/.csv) or a directory of them, or a hub name where the network allows."""

    def __init__(self, path: str, split: str = "train", name: str | None = None) -> None:
        try:
            import datasets
        except ImportError as exc:  # pragma: no cover - datasets is a dependency
            raise ImportError("data.source: hf needs the `datasets` package (pip install datasets)") from exc
        local = Path(path)
        if not local.exists() and (local.is_absolute() or path.startswith(".")):
            raise FileNotFoundError(f"data.path {path} does not exist (a hub name looks like 'org/name')")
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # what `save_to_disk` writes
        if any((local / name).is_file() for name in saved):
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"data.path {path}: no split {split!r} (data.split; it has {sorted(loaded)})")
                loaded = loaded[split]
        elif local.is_file():
            builder = _HF_BUILDERS.get(local.suffix)
            if builder is None:
                raise ValueError(f"data.path {path}: unknown file type {local.suffix!r} "
                                 f"(known: {', '.join(_HF_BUILDERS)})")
            loaded = datasets.load_dataset(builder, data_files=str(local), split=split)
        else:
            loaded = datasets.load_dataset(path, split=split)
        self.dataset = loaded
        self.path = path
        self.split = split
        self.name = name or (local.stem if local.exists() else path.replace("/", "_"))

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, index: int) -> tuple[Any, str]:
        return self.dataset[index], f"{self.path}[{self.split}][{index}]"


class IterableSource:
    """Rows from Python: a sequence is indexed as it is; any other (finite) iterable is read into a
    list once. Rows may be dicts in the row format, or ready `Task`s."""

    def __init__(self, rows: Iterable[Any], name: str = "rows") -> None:
        self.rows: Sequence[Any] = rows if isinstance(rows, Sequence) else list(rows)
        self.name = name

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> tuple[Any, str]:
        return self.rows[index], f"{self.name}[{index}]"
