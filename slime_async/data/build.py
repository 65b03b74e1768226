"""From the config's `data:` and `env:` sections to what the Scheduler takes: the env(s) and a task stream.

The launcher calls `build_envs(cfg)` and `build_tasks(cfg, envs, state=saved_state)`; it saves
`stream.state()` with its checkpoints (`save_state`/`load_state`), so a restarted run continues
the data where it stopped.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from slime_async.config.schema import Config, DatasetConfig, EnvConfig
from slime_async.data.router import EnvRouter
from slime_async.data.rows import RowFormat
from slime_async.data.slime_compat import SLIME_ENV_NAME, SlimeGenerateFactory
from slime_async.data.sources import HFSource, IterableSource, JsonlSource, RowSource
from slime_async.data.stream import DataState, TaskStream
from slime_async.env import EnvFactory


def build_envs(cfg: Config) -> EnvFactory | EnvRouter:
    """`data.envs` as a router when rows choose their environment, else the run's `env`."""
    d = cfg.data
    if d.envs:
        factories = {name: env_factory(e) for name, e in d.envs.items()}
        return EnvRouter(factories, default=d.default_env)
    return env_factory(cfg.env)


def env_factory(env: EnvConfig) -> EnvFactory:
    """The factory of one `env:` entry; SLIME_ENV_NAME runs a slime generate function instead of an Env."""
    if env.name == SLIME_ENV_NAME:
        return SlimeGenerateFactory.from_args(env.args)
    return EnvFactory.from_config(env.name, env.args)


def row_format(ds: DatasetConfig) -> RowFormat:
    return RowFormat(input_key=ds.input_key, label_key=ds.label_key, metadata_key=ds.metadata_key,
                     id_key=ds.id_key, env_key=ds.env_key)


def open_source(ds: DatasetConfig, env: EnvFactory | None = None, name: str | None = None) -> RowSource:
    """The row source that `ds` describes; `env` supplies the tasks when `ds.source` is `env`."""
    if ds.source == "jsonl":
        assert ds.path is not None  # checked by the schema
        return JsonlSource(ds.path, name=name)
    if ds.source == "hf":
        assert ds.path is not None
        return HFSource(ds.path, split=ds.split, name=name)
    if env is None:
        raise ValueError("data.source is 'env' but there is no single env to ask (data.envs is a router): "
                         "set data.source to jsonl or hf")
    if ds.split not in ("train", "eval"):
        raise ValueError(f"data.split: an env's own tasks have splits 'train' and 'eval', not {ds.split!r}")
    try:
        tasks = list(env.tasks(ds.split))  # type: ignore[arg-type]
    except NotImplementedError as exc:
        raise ValueError(f"{exc}: set data.source to jsonl or hf and data.path") from None
    return IterableSource(tasks, name=name or env.name)


def build_tasks(cfg: Config, envs: EnvFactory | EnvRouter, state: DataState | None = None,
                shard: tuple[int, int] = (0, 1)) -> TaskStream:
    """The training task stream of the config, resumed from `state` when given; `shard=(i, k)` for
    rollout worker i of k (each row goes to one worker per epoch)."""
    d = cfg.data
    single = envs if isinstance(envs, EnvFactory) else None
    if d.source == "env" and single is None:
        single = env_factory(cfg.env)
    source = open_source(d, single)
    return TaskStream(
        source, row_format(d), shuffle=d.shuffle and d.source != "env",
        seed=d.seed if d.seed is not None else cfg.run.seed, epochs=d.epochs, on_bad_row=d.on_bad_row,
        max_skipped=d.max_skipped, validate=envs.check if isinstance(envs, EnvRouter) else None, state=state,
        shard=shard,
    )


def save_state(state: DataState, path: str | Path) -> None:
    """Write the stream's position as JSON (atomically: a crash mid-write keeps the old file)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    tmp.replace(path)


def load_state(path: str | Path) -> DataState:
    """Read a position written by `save_state`; a damaged file is an error naming it."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=DataState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"data state {path}: {exc}") from None
