"""chat: data-only tasks (a JSONL of problems and labels) scored by a verifier chosen in config.

Single-turn by default: the model answers once, the reply is scored. With `max_attempts > 1` it is
multi-turn: a wrong answer gets `retry_message` and another try, the last answer is scored (the
metric `attempts` counts the tries). Verifiers (`envs.verifiers`): `math` (math-verify
equivalence), `exact`, `regex` (the label is a pattern), `f1`, or `judge` (a remote LLM judge or
reward model, `slime_async.data.remote_reward`). A JSONL of math problems trains
with no Python written:

    env: {name: "envs.chat:ChatEnv", args: {verifier: math}}
    data: {source: jsonl, path: math.jsonl}
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from envs.verifiers import VerifierName, score
from slime_async.data.remote_reward import RemoteRewardArgs, shared_remote_reward
from slime_async.env import Env, EnvArgs, Limits, metric, reward
from slime_async.types import Message, Task


class ChatArgs(EnvArgs):
    verifier: VerifierName | Literal["judge"] = "exact"
    """`math`, `exact`, `regex`, `f1` (envs.verifiers), or `judge`: a remote LLM judge / reward model."""
    judge: RemoteRewardArgs | None = None
    """The judge or reward model of `verifier: judge` (slime_async.data.RemoteRewardArgs)."""
    answer_pattern: str | None = None
    """A regex that finds the answer in a reply (its first group, if any; the last match counts);
    null: the last `\\boxed{}`, else what follows "the answer is", else the whole reply
    (math-verify searches the whole reply itself)."""
    system_prompt: str | None = None
    """Prepended to text prompts (chat-message prompts are used as they are)."""
    max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Tries per episode: 1 is single-turn; more lets the model retry after a wrong answer."""
    retry_message: str = "That is not correct. Try again."
    show_tool_schemas: bool = False
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=8, max_tool_calls=0))

    def __post_init__(self) -> None:
        if self.verifier == "judge" and self.judge is None:
            raise ValueError("verifier 'judge' needs judge: {url: ...}")


class ChatEnv(Env):
    Args = ChatArgs
    args: ChatArgs

    def __init__(self, args: ChatArgs | None = None) -> None:
        super().__init__(args)
        self.show_tools = self.args.show_tool_schemas
        self.attempts = 0
        self._scored: dict[str, float] = {}

    def prompt(self, task: Task) -> list[Message]:
        if isinstance(task.prompt, str) and self.args.system_prompt:
            return [Message(role="system", content=self.args.system_prompt), Message(role="user", content=task.prompt)]
        return super().prompt(task)

    async def on_reply(self, message: Message) -> list[Message] | None:
        self.attempts += 1
        if self.attempts >= self.args.max_attempts:
            return None
        if await self.check(message.content) >= 1.0:
            return None
        return [Message(role="user", content=self.args.retry_message)]

    async def check(self, reply: str) -> float:
        """The verifier's score of `reply` (cached: a reply checked in `on_reply` is not checked again)."""
        if reply not in self._scored:
            assert self.task is not None
            if self.args.judge is not None and self.args.verifier == "judge":
                judge = shared_remote_reward(self.args.judge)
                value = await judge.score(self.task.prompt, reply, self.task.answer)
            else:
                value = await self.verify(score, self.args.verifier, reply, self.task.answer, self.args.answer_pattern)
            self._scored[reply] = float(value)
        return self._scored[reply]

    @reward
    async def correct(self, completion: str) -> float:
        """The verifier's score of the last reply."""
        return await self.check(completion)

    @metric
    def attempts_used(self) -> float:
        return float(self.attempts)
