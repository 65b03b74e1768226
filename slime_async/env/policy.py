"""The policy interface that episodes call, and `ScriptedPolicy` for offline tests.

The rollout scheduler implements `Policy` over HTTP (SGLang's `POST /generate`, token in, token
out); `run_episode` only ever calls `generate`. Retries, failover and abort-and-resume across a
weight update belong to that implementation: what it returns is the final output of one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "abort"]


class ServerError(RuntimeError):
    """Every server failed the request within the retry budget; the message says how. What a `Policy`
    over inference servers raises (`rollout.SGLangClient`), named here so that code outside `rollout`
    (slime's generate functions in `data.slime_compat`) can tell a server's failure from its own."""


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters of one model call, with SGLang's names."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    stop: list[str] = []
    """Stop strings: the output ends with the first one it produces (which stays in the tokens)."""
    sampling_seed: int | None = None
    """Seed of this call's sampler (an OpenAI `seed`); None: the server's own randomness."""

    @classmethod
    def from_config(cls, sampling: Any) -> Sampling:
        """From a config `SamplingConfig` (the `rollout.sampling` section or an eval suite's)."""
        return cls(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                   max_new_tokens=sampling.max_new_tokens)

    def to_sglang(self) -> dict[str, Any]:
        """`sampling_params` of SGLang's `/generate`."""
        out = msgspec.structs.asdict(self)
        for unset in ("stop_token_ids", "stop", "sampling_seed"):  # SGLang's defaults: not sent
            if not out[unset] and out[unset] != 0:
                del out[unset]
        return out


class Generation(msgspec.Struct, kw_only=True):
    """What one model call produced. Lists are accepted; `run_episode` stores arrays."""

    completion_ids: Sequence[int] | np.ndarray
    """Exactly the server's output ids, including the stop token that ended it, if any."""
    logprobs: Sequence[float] | np.ndarray
    """Behaviour logprob of each output token."""
    versions: Sequence[int] | np.ndarray
    """Weight version that produced each output token."""
    finish_reason: FinishReason
    """`stop` (a stop token or string), `length` (max_new_tokens), `abort` (the server gave up on it)."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay: the experts the engine routed each position of the sequence to, from its
    start (or its latest new branch) to the last-but-one output token, [positions, layers x top_k]
    (`slime_async.moe.routing`); `run_episode` splits it over the turns. None: not recorded."""


class Policy(Protocol):
    """Anything that turns a conversation's token ids into a continuation."""

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        """Continue `input_ids` (the whole conversation so far; the server's prefix cache makes
        the repeated part cheap). Raise when the call failed for good (StopReason.SERVER_ERROR)."""
        ...


class ScriptExhausted(RuntimeError):
    """A ScriptedPolicy was asked for more replies than it was given."""


class ScriptedPolicy:
    """Replays given reply texts, tokenized with the model's tokenizer, as if generated.

    Each reply is followed by the tokenizer's EOS (the server includes its stop token) and is cut
    at `max_new_tokens` (finish_reason `length`) as a server would. Logprobs are 0 and versions
    `version`. `seen` records the input ids of every call, for tests of the token bookkeeping.
    """

    def __init__(self, replies: Sequence[str], tokenizer: Any, version: int = 0) -> None:
        self.replies = list(replies)
        self.tokenizer = tokenizer
        self.version = version
        self.calls = 0
        self.seen: list[list[int]] = []

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        self.seen.append([int(i) for i in input_ids])
        if self.calls >= len(self.replies):
            raise ScriptExhausted(f"the script has {len(self.replies)} replies; call {self.calls + 1} wants another")
        text = self.replies[self.calls]
        self.calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        finish: FinishReason = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return Generation(
            completion_ids=ids, logprobs=[0.0] * len(ids), versions=[self.version] * len(ids), finish_reason=finish
        )
