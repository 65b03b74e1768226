"""Env: the environment API. What a user writes to pose tasks to a model and score its episodes.

Owns:
- `Env` (one async instance per episode: `setup`, `prompt`, `on_reply`, `teardown`), `@tool`
  (JSON schema from type hints and docstrings, validated arguments, injected arguments, sync tools
  in a thread), `@reward(weight=)`, `@metric`, `@group_reward`, and `EnvArgs`/`EnvFactory` that
  build environments from the config's `env.name`/`env.args`;
- `Limits` and `ParseErrorPolicy`: every bound of an episode as a value, each with its StopReason;
- the `Renderer` (the model's chat template applied incrementally; the server's token ids kept
  exactly; loss masks; a new branch where the template is not append-only) and tool-call parsers
  (`HermesParser`, pluggable through the `ToolCallParser` protocol);
- `run_episode` (env + task + policy → Trajectory) and the `Policy` protocol it calls, with
  `ScriptedPolicy` for offline, deterministic tests of an environment;
- `VerifierPool` (CPU-heavy or untrusted verifiers in killable worker processes) and the code
  `sandbox` (model-written code in a separate, resource-limited process without network).

Does not own: HTTP or the inference server (a `Policy` implementation in `rollout` speaks it),
scheduling, concurrency across episodes, staleness, retries (`rollout`); the Structs it produces
(`types`); what happens to trajectories afterwards (`transport`, `buffer`, `train`).
"""

from slime_async.env.base import Env, EnvArgs, Split
from slime_async.env.episode import run_episode
from slime_async.env.episode_loop import COUNTERS
from slime_async.env.group import apply_group_rewards
from slime_async.env.limits import Limits, ParseErrorPolicy
from slime_async.env.loading import EnvFactory, EnvLoadError, load_env_class
from slime_async.env.parsers import HermesParser, ParsedReply, ToolCallParser
from slime_async.env.policy import FinishReason, Generation, Policy, Sampling, ScriptedPolicy, ScriptExhausted
from slime_async.env.renderer import Delta, Renderer
from slime_async.env.rewards import group_reward, metric, reward
from slime_async.env.tools import DefinitionError, Injected, ToolArgumentError, ToolError, ToolSpec, tool
from slime_async.env.verify import VerifierPool

__all__ = [
    "COUNTERS",
    "DefinitionError",
    "Delta",
    "Env",
    "EnvArgs",
    "EnvFactory",
    "EnvLoadError",
    "FinishReason",
    "Generation",
    "HermesParser",
    "Injected",
    "Limits",
    "ParseErrorPolicy",
    "ParsedReply",
    "Policy",
    "Renderer",
    "Sampling",
    "ScriptExhausted",
    "ScriptedPolicy",
    "Split",
    "ToolArgumentError",
    "ToolCallParser",
    "ToolError",
    "ToolSpec",
    "VerifierPool",
    "apply_group_rewards",
    "group_reward",
    "load_env_class",
    "metric",
    "reward",
    "run_episode",
    "tool",
]
