"""`slime-async replay FILE`: run a recorded episode again through its env, with the recorded model
replies and no engine, to see what an env change does to it.

The export file (the dashboard's 'export' link) holds the trajectory and the run's config. Replay
builds the env from that config (or another, `--config`), finds the task by its id in the config's
data, and runs `run_episode` with `RecordedPolicy`, which answers each model call with the recorded
turn's exact tokens, logprobs and versions. Then it compares, turn by turn: the tokens the env added
(tool results, user messages), the stop reason and the rewards.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slime_async.dashboard.trajectory_view import read_export
from slime_async.env.policy import Generation, Sampling
from slime_async.types import Task, Trajectory


class ReplayError(ValueError):
    """The file, its config or its task cannot be replayed; the message says which and why."""


class RecordedPolicy:
    """Answers the i-th model call with the recorded trajectory's i-th turn, token for token."""

    def __init__(self, recorded: Trajectory) -> None:
        self.turns = recorded.turns
        self.calls = 0

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        if self.calls >= len(self.turns):
            # the env wants a turn the recording does not have: the episode changed course
            raise RuntimeError(f"the env asked for model call {self.calls + 1}; the recording has {len(self.turns)}")
        t = self.turns[self.calls]
        self.calls += 1
        finish = t.finish_reason if t.finish_reason in ("stop", "length", "abort") else "stop"
        return Generation(completion_ids=t.completion_ids, logprobs=t.logprobs, versions=t.versions,
                          finish_reason=finish)  # type: ignore[arg-type]


@dataclass
class ReplayReport:
    recorded: Trajectory
    replayed: Trajectory
    tokenizer: Any
    differences: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.differences

    def render(self) -> str:
        r, n = self.recorded, self.replayed
        head = (f"replayed {r.id} (task {r.task_id}, env {r.env}): {len(n.turns)} of {len(r.turns)} recorded turns; "
                f"reward {r.reward:g} -> {n.reward:g}, stop {r.stop_reason.value} -> {n.stop_reason.value}")
        if self.same:
            return head + "\nthe env behaves as recorded: same tokens from the env, same stop reason, same rewards"
        return head + "\n" + "\n".join(f"- {d}" for d in self.differences)


def compare(recorded: Trajectory, replayed: Trajectory, tokenizer: Any) -> list[str]:
    """What differs, in words: the env's tokens turn by turn, the ending, the rewards."""
    out = []
    for i, (a, b) in enumerate(zip(recorded.turns, replayed.turns, strict=False)):
        if not np.array_equal(a.prompt_ids, b.prompt_ids):
            out.append(f"turn {i + 1}: the env's tokens differ:\n    recorded: {_text(tokenizer, a.prompt_ids)!r}\n"
                       f"    now:      {_text(tokenizer, b.prompt_ids)!r}")
    if len(recorded.turns) != len(replayed.turns):
        out.append(f"turns: recorded {len(recorded.turns)}, now {len(replayed.turns)}")
    if recorded.stop_reason != replayed.stop_reason:
        out.append(f"stop reason: recorded {recorded.stop_reason.value}, now {replayed.stop_reason.value}"
                   + (f" ({replayed.error})" if replayed.error else ""))
    if recorded.rewards != replayed.rewards or recorded.reward != replayed.reward:
        out.append(f"rewards: recorded {recorded.reward:g} {recorded.rewards}, "
                   f"now {replayed.reward:g} {replayed.rewards}")
    return out


def _text(tokenizer: Any, ids: np.ndarray) -> str:
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    return text if len(text) <= 400 else text[:180] + " ... " + text[-180:]


def find_task(cfg: Any, envs: Any, task_id: str) -> Task:
    """The task with `task_id` in the config's data (one pass over its train split, then eval)."""
    from slime_async.data.build import env_factory, open_source, row_format
    from slime_async.data.stream import TaskStream
    from slime_async.env import EnvFactory

    single = envs if isinstance(envs, EnvFactory) else None
    if cfg.data.source == "env" and single is None:
        single = env_factory(cfg.env)
    splits = ["train", "eval"] if cfg.data.source == "env" else [cfg.data.split]
    for split in splits:
        d = cfg.data.__class__(**{**{f: getattr(cfg.data, f) for f in cfg.data.__struct_fields__}, "split": split})
        for task in TaskStream(open_source(d, single), row_format(d), epochs=1):
            if task.id == task_id:
                return task
    raise ReplayError(f"task {task_id!r} is not in the config's data ({cfg.data.source}, splits {splits}): "
                      "replay with the config of the run that recorded it (--config)")


async def replay_file(path: Path, config: Path | None = None) -> ReplayReport:
    """Replay the export at `path`; ReplayError for a file, config, task or tokenizer it cannot use."""
    from slime_async.config import ConfigError, load_config
    from slime_async.config.model_dir import load_tokenizer, resolve_model_path
    from slime_async.data.build import build_envs

    try:
        doc, recorded = read_export(path)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    try:
        if config is not None:
            cfg = load_config(config)
        elif doc.get("config"):
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                f.write(doc["config"])
            try:
                cfg = load_config(f.name)
            finally:
                Path(f.name).unlink()
        else:
            raise ReplayError(f"{path}: no config recorded; give one with --config")
        envs = build_envs(cfg)
        tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
    except (ConfigError, OSError) as exc:
        raise ReplayError(f"{path}: its config: {exc}") from None
    task = find_task(cfg, envs, recorded.task_id)
    factory = envs.for_task(task)
    replayed = await factory.episode(task, RecordedPolicy(recorded), tokenizer,
                                     sampling=Sampling.from_config(cfg.rollout.sampling),
                                     group_id=recorded.group_id, sample_index=recorded.sample_index)
    return ReplayReport(recorded, replayed, tokenizer, compare(recorded, replayed, tokenizer))
