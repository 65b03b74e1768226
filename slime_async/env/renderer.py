"""The renderer: a conversation's tokens, kept exactly, extended one turn at a time.

Text never goes back to the server. The renderer keeps the token ids that the server generated
for assistant turns as they are, and appends only the tokens of what came after (the end of the
assistant turn, tool responses, user turns, the next generation prompt), which it gets from the
model's own chat template: it renders the conversation before and after the new messages and
tokenizes the difference. So turn k's tokens are a prefix of turn k+1's (token in, token out),
and nothing is ever re-tokenized.

A template that is not append-only (one that rewrites history, e.g. drops earlier reasoning)
renders the old conversation differently once new messages follow. The renderer notices that
the old rendering is no longer a prefix of the new one and starts a *new branch*: the whole
conversation re-rendered, reported as such, never silently spliced.

A turn does not run the template: `slime_async.env.template` renders each shape of turn once
with placeholders, checks the result against full renders, and a turn fills in its words
(`incremental=False` renders the whole conversation twice a turn instead, as the reference).
"""

from __future__ import annotations

from typing import Any

import msgspec

from slime_async.env.parsers import HermesParser, ParsedReply, ToolCallParser
from slime_async.env.template import VERIFY_USES, facts_for
from slime_async.types import Message

_HERMES = HermesParser()
"""The default parser; it keeps no state between replies, so every renderer shares it."""


class Delta(msgspec.Struct, kw_only=True):
    """Tokens to append before the next model call."""

    ids: list[int]
    new_branch: bool = False
    """True when `ids` is the whole conversation, re-rendered, because the template rewrote history."""


class Renderer:
    """Token bookkeeping of one conversation (one per episode)."""

    def __init__(
        self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, parser: ToolCallParser | None = None,
        *, incremental: bool = True,
    ) -> None:  # fmt: skip
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the renderer needs the model's own template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.parser = parser or _HERMES
        self.incremental = incremental
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self._last_completion: list[int] = []
        # Worked out once per (tokenizer, tools), shared by every episode.
        self.facts = facts_for(tokenizer, self.tools)
        self.stop_ids = self.facts.stop_ids
        """Token ids that end a generation (the server includes the one that matched)."""
        self._closer, self._gen_prompt = self.facts.closer, self.facts.gen_prompt

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (with the tools, if any)."""
        if add_generation_prompt and self._gen_prompt is not None:
            return self.render(messages, add_generation_prompt=False) + self._gen_prompt
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.facts.render(messages, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        # Special tokens in the text are recognised as such; no BOS/EOS is added around it.
        return self.facts.encode(text)

    def start(self, messages: list[Message]) -> list[int]:
        """The first prompt's tokens (the whole rendered prompt plus the generation prompt)."""
        if self.messages:
            raise RuntimeError("Renderer.start called twice; use one renderer per episode")
        self.messages = list(messages)
        text, _ = self._appended([], self.messages)
        self.ids = self.encode(text)
        return list(self.ids)

    def text(self, completion_ids: list[int]) -> str:
        """The completion's text, without the stop token that ended it."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.facts.decode(ids)

    def parse(self, completion_ids: list[int]) -> ParsedReply:
        """What the model said: the completion's text (stop token dropped), parsed for tool calls."""
        return self.parser.parse(self.text(completion_ids))

    def fork(self) -> Renderer:
        """A renderer holding the same conversation, to continue it another way (one of several
        samples of one prompt); the two share nothing that either changes."""
        other = Renderer.__new__(Renderer)
        other.__dict__.update(self.__dict__)
        other.messages, other.ids = list(self.messages), list(self.ids)
        return other

    def add_completion(self, completion_ids: list[int], message: Message) -> None:
        """Record the server's tokens for an assistant turn, exactly, and the message they mean."""
        completion = [int(i) for i in completion_ids]
        self.ids.extend(completion)
        self.messages.append(message)
        self._last_completion = completion

    def extend(self, new_messages: list[Message]) -> Delta:
        """Append environment messages after the last assistant turn, plus the next generation prompt."""
        new = list(new_messages)
        text, whole = self._appended(self.messages, new)
        self.messages = self.messages + new
        if whole:  # the template rewrote history: a new branch, the whole conversation
            self.ids = self.encode(text)
            return Delta(ids=list(self.ids), new_branch=True)
        ids = self.encode(self._rest_of_closer() + text)
        self.ids.extend(ids)
        return Delta(ids=ids)

    def _appended(self, context: list[Message], new: list[Message]) -> tuple[str, bool]:
        """The text that `new` and the generation prompt append to `context`'s rendering; or, with
        True, the whole conversation's text when `context`'s rendering is not a prefix of it."""
        found = self.facts.skeleton(context, new) if self.incremental else None
        if found is not None:
            skeleton, values = found
            text = skeleton.fill(values)
            if skeleton.uses >= VERIFY_USES:
                return text, False
            skeleton.uses += 1
            full = self._full(context, new)
            if full == (text, False):
                return full
            self.facts.rejected(skeleton)
            return full
        return self._full(context, new)

    def _full(self, context: list[Message], new: list[Message]) -> tuple[str, bool]:
        """The reference: render the conversation before and after, take the difference."""
        before = self.render(context, add_generation_prompt=False) if context else ""
        after = self.render(context + new, add_generation_prompt=True)
        if not after.startswith(before):
            return after, True
        return after[len(before):], False

    def _rest_of_closer(self) -> str:
        """The part of the template's end-of-assistant-turn text that the completion did not
        produce itself: all of it after a reply cut by length, the rest after the stop token."""
        last = self._last_completion
        if last and last[-1] in self.stop_ids:
            stop_text = self.facts.stop_text(last[-1])
            if self._closer.startswith(stop_text):
                return self._closer[len(stop_text) :]
        return self._closer
