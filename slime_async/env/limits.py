"""Limits and policies of an episode, as values (set in `env.args.limits` or passed to `run_episode`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class ParseErrorPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What happens when the model's reply holds a tool call that cannot be parsed (bad JSON,
    an unterminated `<tool_call>`, a call without a name)."""

    feedback: bool = True
    """Tell the model what was wrong (as a tool response) and let it try again. False ends the
    episode at the first bad reply with StopReason.PARSE_ERROR."""
    max_consecutive: PositiveInt = 3
    """Give up (StopReason.PARSE_ERROR) after this many bad replies in a row."""
    penalty: float = 0.0
    """Added to the reward once per bad reply (use a negative number), as the reward `parse_error`."""
    mask_bad_turn: bool = False
    """Do not train on a bad reply's tokens (loss mask 0)."""


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds on one episode. Each one that is hit ends the episode with its own StopReason."""

    max_turns: PositiveInt = 8
    """Model calls per episode (StopReason.MAX_TURNS)."""
    max_tool_calls: NonNegativeInt = 16
    """Tool calls per episode; a reply whose calls would pass it ends the episode
    (StopReason.MAX_TOOL_CALLS) without running them."""
    max_total_tokens: PositiveInt = 4096
    """Prompt plus generated tokens of the whole conversation (StopReason.MAX_TOKENS). Each model
    call's `max_new_tokens` is clamped to what is left."""
    turn_timeout_s: PositiveFloat | None = None
    """Wall-clock limit of one turn: the model call plus its tools (StopReason.TURN_TIMEOUT)."""
    episode_timeout_s: PositiveFloat | None = None
    """Wall-clock limit of the whole episode before rewards (StopReason.EPISODE_TIMEOUT)."""
    tool_timeout_s: PositiveFloat = 30.0
    """Wall-clock limit of one tool call; past it the model is told that the tool timed out.
    (A sync tool runs in a thread, which Python cannot kill: it is abandoned, not stopped. Tools
    that may hang for real should use the sandbox, which kills its process.)"""
    max_tool_output_chars: PositiveInt = 4000
    """A longer tool result is cut to this many characters, with a note that says how many were cut."""
    max_parallel_tools: PositiveInt = 4
    """Tool calls of one reply run concurrently, at most this many at a time."""
    reward_timeout_s: PositiveFloat = 30.0
    """Wall-clock limit of each `@reward`/`@metric`; one that times out or raises scores its
    `on_error` value and is counted."""
    teardown_timeout_s: PositiveFloat = 30.0
    """Wall-clock limit of `Env.teardown`."""
    parse_errors: ParseErrorPolicy = msgspec.field(default_factory=ParseErrorPolicy)
