"""The Structs that every part of slime_async passes around.

One episode of an agent is a `Trajectory`: the `Task` it solved, and the `Turn`s it took. A
turn is what the environment appended to the conversation (prompt tokens, never trained on)
followed by what the model generated (completion tokens, each with its logprob and the weight
version that produced it). Tokens are the truth: text is only ever derived from them.
"""

from __future__ import annotations

import enum
import os
from typing import Any, Literal

import msgspec
import numpy as np

from slime_async.types.arrays import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    ROUTE16_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    as_array,
)

SCHEMA_VERSION = 1
"""Version of the wire schema. Bump it when a field changes meaning or a required field is added;
readers reject frames from a newer schema instead of misreading them."""

Role = Literal["system", "user", "assistant", "tool"]
JSON = Any
"""A value that JSON can hold: dict, list, str, int, float, bool or None."""


def new_id() -> str:
    """A fresh random identifier (32 hex digits), unique across workers and restarts."""
    # 128 random bits from the OS, as uuid4 has (less its 6 fixed bits), without building a
    # UUID object: 0.6 us instead of 2.4, and an episode takes three (group, trajectory, call).
    return os.urandom(16).hex()


class StopReason(enum.Enum):
    """Why an episode ended. Every ending has exactly one."""

    DONE = "done"
    """The environment declared the episode finished (an answer was given, the game ended)."""
    TRUNCATED = "truncated"
    """The model's reply hit `max_new_tokens` and the environment could not continue from it."""
    MAX_TURNS = "max_turns"
    """The turn limit was reached."""
    MAX_TOOL_CALLS = "max_tool_calls"
    """The tool-call limit was reached."""
    MAX_TOKENS = "max_tokens"
    """The episode's total token budget (or the model's context) was exhausted."""
    TURN_TIMEOUT = "turn_timeout"
    """One turn (generation plus tools) ran past its wall-clock limit."""
    EPISODE_TIMEOUT = "episode_timeout"
    """The whole episode ran past its wall-clock limit."""
    PARSE_ERROR = "parse_error"
    """The model's replies could not be parsed (bad tool-call JSON) too many times in a row."""
    ENV_ERROR = "env_error"
    """The environment itself raised (setup, a reward, on_reply); the message is in `metrics`/`error`."""
    SERVER_ERROR = "server_error"
    """The inference server failed the request after retries and failover."""
    ABORTED = "aborted"
    """The episode was cancelled (shutdown, or the scheduler withdrew it)."""


class ToolCall(msgspec.Struct, kw_only=True):
    """One call of a tool, as parsed from the model's reply."""

    name: str
    """The tool's name, as the environment declares it."""
    arguments: dict[str, JSON] = {}
    """Arguments by name, parsed from JSON (not yet validated against the tool's schema)."""
    id: str = msgspec.field(default_factory=lambda: "call_" + new_id()[:12])
    """Identifier that the tool's response refers back to."""


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chat message, in the shape chat templates expect."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = []
    """Calls the assistant made in this message (assistant messages only)."""
    tool_call_id: str | None = None
    """For a tool message: the id of the call it answers."""
    name: str | None = None
    """For a tool message: the name of the tool that answered."""

    def to_chat(self) -> dict[str, JSON]:
        """This message as the dict that HF chat templates take (OpenAI's shape)."""
        out: dict[str, JSON] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Task(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One problem for an environment to pose."""

    id: str
    """Stable identifier, unique within its data source (used for grouping and resume)."""
    prompt: str | list[Message]
    """The problem as text (the env wraps it in messages) or as ready chat messages."""
    answer: JSON = None
    """The label a verifier checks against (slime calls it `label`)."""
    metadata: dict[str, JSON] = {}
    """Anything else the environment needs (difficulty, hidden tests, the split)."""


class Turn(msgspec.Struct, kw_only=True):
    """One model call of an episode and the tokens around it.

    `prompt_ids` are the tokens appended to the conversation before this call (the whole rendered
    prompt on the first turn, then tool responses and user messages): environment tokens, never
    trained on. `completion_ids` are the tokens the server generated, with one logprob, one weight
    version and one loss-mask value each. Lists are accepted on construction and become arrays.
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    """Behaviour logprob of each completion token, as the inference server reported it."""
    versions: np.ndarray
    """Weight version that produced each completion token."""
    loss_mask: np.ndarray | None = None
    """1 for a completion token to train on, 0 to ignore (e.g. a masked malformed turn).
    None means all ones."""
    finish_reason: str = ""
    """The server's finish reason for this call: stop, length or abort."""
    new_branch: bool = False
    """True when `prompt_ids` is the whole context rather than an extension of the previous
    turns: the chat template rewrote history (e.g. dropped earlier reasoning), so from this turn
    on the tokens form a new sequence."""
    routed_experts: np.ndarray | None = None
    """MoE models with routing replay: the experts the engine chose for each token of `prompt_ids`
    then `completion_ids`, flat, (layers x top_k) ids per token (uint8, or int16 past 255 experts);
    a token the engine never reported is all 255 (-1). None: not recorded. `slime_async.moe.routing`."""
    teacher_logprobs: np.ndarray | None = None
    """On-policy distillation (`train.distill`): the teacher's logprob of each completion token given
    everything before it, as the teacher server scored it (`slime_async.rollout.teacher`). None: not
    scored (distillation off, or the teacher was unavailable: the turn then trains without the KL term)."""

    def __post_init__(self) -> None:
        self.prompt_ids = as_array(self.prompt_ids, TOKEN_DTYPE, "prompt_ids")
        self.completion_ids = as_array(self.completion_ids, TOKEN_DTYPE, "completion_ids")
        self.logprobs = as_array(self.logprobs, LOGPROB_DTYPE, "logprobs")
        self.versions = as_array(self.versions, VERSION_DTYPE, "versions")
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.completion_ids), dtype=MASK_DTYPE)
        else:
            self.loss_mask = as_array(self.loss_mask, MASK_DTYPE, "loss_mask")
        n = len(self.completion_ids)
        if self.routed_experts is not None:
            routes = _route_array(self.routed_experts)
            if routes.dtype not in (MASK_DTYPE, ROUTE16_DTYPE) or routes.ndim != 1:
                raise ValueError(f"routed_experts: expected a flat uint8 or int16 array, got {routes.dtype} "
                                 f"of shape {routes.shape}")
            tokens = len(self.prompt_ids) + n
            if tokens and len(routes) % tokens:
                raise ValueError(f"routed_experts has {len(routes)} ids, not a whole number per token for "
                                 f"{tokens} prompt and completion tokens")
            self.routed_experts = routes
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = as_array(self.teacher_logprobs, LOGPROB_DTYPE, "teacher_logprobs")
            if len(self.teacher_logprobs) != n:
                raise ValueError(f"teacher_logprobs has {len(self.teacher_logprobs)} entries but completion_ids "
                                 f"has {n}: the teacher scores every completion token or none")
        for field in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, field)) != n:
                raise ValueError(
                    f"{field} has {len(getattr(self, field))} entries but completion_ids has {n}: "
                    "every completion token needs exactly one"
                )


def _route_array(values: Any) -> np.ndarray:
    """A routed-experts record as its wire dtype. Lists (a JSON file's) become uint8 when every value
    fits (255 is then the unreported marker), else int16 (-1 the marker)."""
    routes = np.asarray(values)
    if routes.dtype in (MASK_DTYPE, ROUTE16_DTYPE) or routes.dtype.kind not in "iu" or not routes.size:
        return routes.astype(MASK_DTYPE) if not routes.size else routes
    if int(routes.min()) >= 0 and int(routes.max()) <= 255:
        return routes.astype(MASK_DTYPE)
    if int(routes.min()) >= -1 and int(routes.max()) < 2**15:
        return routes.astype(ROUTE16_DTYPE)
    return routes


class Trajectory(msgspec.Struct, kw_only=True):
    """One finished episode: the unit that travels from rollout workers to the trainer."""

    task_id: str
    group_id: str
    """Episodes of the same task sampled together (GRPO's group) share this."""
    sample_index: int
    """Position of this episode within its group, 0..n-1."""
    turns: list[Turn]
    stop_reason: StopReason
    rewards: dict[str, float] = {}
    """Each named reward, unweighted, as the environment's `@reward` methods returned them."""
    reward: float = 0.0
    """The scalar that trains: the weighted sum of `rewards` (plus any group reward)."""
    metrics: dict[str, float] = {}
    """Named measurements that do not train (tool calls made, answer length, ...)."""
    timings: dict[str, float] = {}
    """Seconds spent, by phase (generate, tools, reward, total)."""
    env: str = ""
    """Which environment produced it, as named in the config (`envs.calculator:CalculatorEnv`)."""
    error: str = ""
    """What went wrong first, for people: an ENV_ERROR or SERVER_ERROR ending, or a reward that raised."""
    errors: dict[str, str] = {}
    """The first error message of each part of the env that failed in this episode, keyed by its kind
    and name (`reward exact`, `metric length`, `tool convert`, `group_reward rank`); their counts are
    in `metrics` (`reward_errors/exact`, `tool_errors/convert`). Empty when nothing failed."""
    id: str = msgspec.field(default_factory=new_id)
    """Unique id; the buffer de-duplicates on it, so redelivery never trains twice."""
    schema_version: int = SCHEMA_VERSION

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.turns)

    def min_version(self) -> int | None:
        """Oldest weight version among the generated tokens (None if none were generated)."""
        versions = [int(t.versions.min()) for t in self.turns if len(t.versions)]
        return min(versions) if versions else None

    def staleness(self, trainer_version: int) -> int:
        """docs/architecture.md's rule ("Staleness"): trainer version minus the oldest version among its tokens."""
        oldest = self.min_version()
        return 0 if oldest is None else trainer_version - oldest

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The whole sequence as (token ids, behaviour logprobs, loss mask), one entry per token.

        Prompt tokens have logprob 0 and mask 0; completion tokens keep theirs. A trajectory
        whose later turns start a new branch is not one sequence: that is an error here (see
        `segments`).
        """
        segments = self.segments()
        if len(segments) > 1:
            raise ValueError(
                f"trajectory {self.id} has turns that start a new branch (the chat template is not "
                "append-only, or an agent rewrote its history): it is several sequences, see segments()"
            )
        if not segments:
            return np.zeros(0, TOKEN_DTYPE), np.zeros(0, LOGPROB_DTYPE), np.zeros(0, MASK_DTYPE)
        return segments[0]

    def segments(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The sequences the trajectory is made of, each as `flat` gives one: a new one starts at
        every turn with `new_branch` (its prompt is the whole context again)."""
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        ids: list[np.ndarray] = []
        logprobs: list[np.ndarray] = []
        mask: list[np.ndarray] = []
        for i, t in enumerate(self.turns):
            if t.new_branch and i > 0:
                out.append((np.concatenate(ids), np.concatenate(logprobs), np.concatenate(mask)))
                ids, logprobs, mask = [], [], []
            ids += [t.prompt_ids, t.completion_ids]
            logprobs += [np.zeros(len(t.prompt_ids), LOGPROB_DTYPE), t.logprobs]
            mask += [np.zeros(len(t.prompt_ids), MASK_DTYPE), t.loss_mask]
        if ids:
            out.append((np.concatenate(ids), np.concatenate(logprobs), np.concatenate(mask)))
        return out


class Group(msgspec.Struct, kw_only=True):
    """The episodes sampled together for one task (GRPO normalises rewards within it)."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]
    schema_version: int = SCHEMA_VERSION

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
