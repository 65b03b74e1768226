"""From one raw dataset row (a dict) to a `Task`, in slime's format, with the place of the row in errors.

slime's rows are `{"prompt": "..." | [{"role": ..., "content": ...}, ...], "label": ..., "metadata": {...}}`,
with the key names configurable (`--input-key`, `--label-key`, `--metadata-key`); `RowFormat`
holds the same choices. A row that cannot become a Task raises `BadRow`, whose message names the
file and line (or the dataset and index) and what is wrong.
"""

from __future__ import annotations

from typing import Any

import msgspec

from slime_async.types import Message, Task


class BadRow(ValueError):
    """A dataset row that cannot become a Task; `place` is "FILE:LINE" or "DATASET[INDEX]"."""

    def __init__(self, place: str, reason: str) -> None:
        super().__init__(f"{place}: {reason}")
        self.place, self.reason = place, reason


class RowFormat(msgspec.Struct, frozen=True, kw_only=True):
    """Which keys of a row hold what (slime's `--input-key`, `--label-key`, `--metadata-key`)."""

    input_key: str = "prompt"
    """The prompt: text, or a list of chat messages (`{"role", "content"}` dicts)."""
    label_key: str | None = "label"
    """The label (Task.answer); None: rows carry no label."""
    metadata_key: str | None = "metadata"
    """A dict of extra fields copied into Task.metadata; absent or null is fine."""
    id_key: str | None = None
    """A stable task id; None: the id is `SOURCE:INDEX` (stable across shuffles and restarts)."""
    env_key: str | None = None
    """A column naming the environment of the row (one of `data.envs`); copied to
    `Task.metadata["env"]`, where `EnvRouter` reads it."""


ENV_METADATA_KEY = "env"
"""Where a row's environment name goes in Task.metadata (read by `EnvRouter`)."""


def row_to_task(row: Any, fmt: RowFormat, place: str, default_id: str) -> Task:
    """The Task of `row`; raises BadRow naming `place` when a key is missing or has the wrong shape."""
    if not isinstance(row, dict):
        raise BadRow(place, f"a row must be a JSON object, got {type(row).__name__}")
    if fmt.input_key not in row or row[fmt.input_key] is None:
        raise BadRow(place, f"missing prompt key {fmt.input_key!r} (keys: {sorted(row)[:10]}); set input_key")
    prompt = _prompt(row[fmt.input_key], place, fmt.input_key)
    answer = None
    if fmt.label_key is not None:
        if fmt.label_key not in row:
            raise BadRow(place, f"missing label key {fmt.label_key!r} (keys: {sorted(row)[:10]}); set label_key "
                                "(or label_key: null for rows without labels)")
        answer = row[fmt.label_key]
    metadata: dict[str, Any] = {}
    if fmt.metadata_key is not None and row.get(fmt.metadata_key) is not None:
        meta = row[fmt.metadata_key]
        if not isinstance(meta, dict):
            raise BadRow(place, f"{fmt.metadata_key!r} must be an object, got {type(meta).__name__}")
        metadata.update(meta)
    if fmt.env_key is not None and row.get(fmt.env_key) is not None:
        # An absent value leaves the choice to the router (its default, or a bad row without one).
        env = row[fmt.env_key]
        if not isinstance(env, str) or not env:
            raise BadRow(place, f"{fmt.env_key!r} must be a non-empty string naming one of data.envs, got {env!r}")
        metadata[ENV_METADATA_KEY] = env
    task_id = default_id
    if fmt.id_key is not None:
        if row.get(fmt.id_key) in (None, ""):
            raise BadRow(place, f"missing id key {fmt.id_key!r}")
        task_id = str(row[fmt.id_key])
    return Task(id=task_id, prompt=prompt, answer=answer, metadata=metadata)


def _prompt(value: Any, place: str, key: str) -> str | list[Message]:
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(place, f"{key!r} is empty")
        return value
    if isinstance(value, list) and value:
        try:
            return msgspec.convert(value, list[Message])
        except msgspec.ValidationError as exc:
            raise BadRow(place, f"{key!r} is not a list of chat messages: {exc}") from None
    raise BadRow(place, f"{key!r} must be text or a non-empty list of chat messages, got {type(value).__name__}")
