"""Data: where tasks come from, how they are scored from outside, and slime's way in.

Owns:
- task sources (`sources`: JSONL in slime's row format, Hugging Face `datasets`, Python
  iterables), the row format and bad-row errors naming file and line (`rows`), the task stream
  with seeded shuffling, epochs, a skip policy and a resumable position (`stream`: `TaskStream`,
  `DataState`), per-task environment choice (`router`: `EnvRouter`), and building all that from
  the config's `data:` section (`build`);
- remote rewards: an HTTP reward-model / LLM-judge client for `@reward`/`@group_reward` (`remote_reward`);
- slime compatibility: running a slime-style `async generate(args, sample, sampling_params)`
  inside the scheduler (`slime_compat`).

Does not own: what an episode does (`env`, `envs/`), scheduling and HTTP to the engines (`rollout`),
evaluation suites and the evaluation worker (`evaluation`, which builds on this part and on
`rollout`), checkpoint files (the rollout worker saves its `DataState` with `--data-state`).
"""

from slime_async.data.build import build_envs, build_tasks, env_factory, load_state, open_source, row_format, save_state
from slime_async.data.remote_reward import (
    RemoteReward,
    RemoteRewardArgs,
    RemoteRewardError,
    close_shared_remote_rewards,
    shared_remote_reward,
)
from slime_async.data.router import EnvRouter, UnknownEnv
from slime_async.data.rows import ENV_METADATA_KEY, BadRow, RowFormat, row_to_task
from slime_async.data.slime_compat import (
    SLIME_ENV_NAME,
    Sample,
    SlimeGenerateArgs,
    SlimeGenerateFactory,
    load_function,
    to_turns,
)
from slime_async.data.sources import HFSource, IterableSource, JsonlSource, RowSource
from slime_async.data.stream import DataState, TaskStream, TooManyBadRows

__all__ = [
    "ENV_METADATA_KEY",
    "SLIME_ENV_NAME",
    "BadRow",
    "DataState",
    "EnvRouter",
    "HFSource",
    "IterableSource",
    "JsonlSource",
    "RemoteReward",
    "RemoteRewardArgs",
    "RemoteRewardError",
    "RowFormat",
    "RowSource",
    "Sample",
    "SlimeGenerateArgs",
    "SlimeGenerateFactory",
    "TaskStream",
    "TooManyBadRows",
    "UnknownEnv",
    "build_envs",
    "build_tasks",
    "close_shared_remote_rewards",
    "env_factory",
    "load_function",
    "load_state",
    "open_source",
    "row_format",
    "row_to_task",
    "save_state",
    "shared_remote_reward",
    "to_turns",
]
