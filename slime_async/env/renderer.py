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
"""

from __future__ import annotations

from typing import Any

import msgspec

from slime_async.env.parsers import HermesParser, ParsedReply, ToolCallParser
from slime_async.types import Message

_PROBE = "\x00slime-probe\x00"
# Per (tokenizer, tools): what the template writes after an assistant message, and its generation
# prompt when that is a constant suffix. Rendering the template is most of an episode's CPU on the
# rollout side (about 0.3 ms a render), so these are worked out once, not per episode.
_TEMPLATE_FACTS: dict[tuple[int, str], tuple[str, str | None]] = {}


class Delta(msgspec.Struct, kw_only=True):
    """Tokens to append before the next model call."""

    ids: list[int]
    new_branch: bool = False
    """True when `ids` is the whole conversation, re-rendered, because the template rewrote history."""


class Renderer:
    """Token bookkeeping of one conversation (one per episode)."""

    def __init__(
        self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, parser: ToolCallParser | None = None
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the renderer needs the model's own template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.parser = parser or HermesParser()
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self._text = ""  # the template's rendering of `messages` (without a generation prompt)
        # Token ids that end a generation (the server includes the one that matched).
        candidates = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.stop_ids = {i for i in candidates if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id}
        key = (id(tokenizer), msgspec.json.encode(self.tools).decode())
        if key not in _TEMPLATE_FACTS:
            _TEMPLATE_FACTS[key] = (self._assistant_closer(), self._generation_prompt())
        self._closer, self._gen_prompt = _TEMPLATE_FACTS[key]

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (with the tools, if any)."""
        if add_generation_prompt and self._gen_prompt is not None:
            return self.render(messages, add_generation_prompt=False) + self._gen_prompt
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_chat() for m in messages],
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        # Special tokens in the text are recognised as such; no BOS/EOS is added around it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, messages: list[Message]) -> list[int]:
        """The first prompt's tokens (the whole rendered prompt plus the generation prompt)."""
        if self.messages:
            raise RuntimeError("Renderer.start called twice; use one renderer per episode")
        self.messages = list(messages)
        self._text = self.render(self.messages, add_generation_prompt=False)
        with_prompt = self._text + self._gen_prompt if self._gen_prompt is not None else self.render(
            self.messages, add_generation_prompt=True)
        self.ids = self.encode(with_prompt)
        return list(self.ids)

    def parse(self, completion_ids: list[int]) -> ParsedReply:
        """What the model said: the completion's text (stop token dropped), parsed for tool calls."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.parser.parse(self.tokenizer.decode(ids, skip_special_tokens=False))

    def add_completion(self, completion_ids: list[int], message: Message) -> None:
        """Record the server's tokens for an assistant turn, exactly, and the message they mean."""
        self.ids.extend(int(i) for i in completion_ids)
        self.messages.append(message)
        self._last_completion = list(completion_ids)
        self._text = self.render(self.messages, add_generation_prompt=False)

    def extend(self, new_messages: list[Message]) -> Delta:
        """Append environment messages after the last assistant turn, plus the next generation prompt."""
        before = self._text
        messages = self.messages + list(new_messages)
        self.messages = messages
        self._text = self.render(messages, add_generation_prompt=False)
        after = self._text + self._gen_prompt if self._gen_prompt is not None else self.render(
            messages, add_generation_prompt=True)
        if not after.startswith(before):
            self.ids = self.encode(after)
            return Delta(ids=list(self.ids), new_branch=True)
        ids = self.encode(self._rest_of_closer() + after[len(before) :])
        self.ids.extend(ids)
        return Delta(ids=ids)

    def _rest_of_closer(self) -> str:
        """The part of the template's end-of-assistant-turn text that the completion did not
        produce itself: all of it after a reply cut by length, the rest after the stop token."""
        last = getattr(self, "_last_completion", [])
        if last and last[-1] in self.stop_ids:
            stop_text = self.tokenizer.decode([last[-1]], skip_special_tokens=False)
            if self._closer.startswith(stop_text):
                return self._closer[len(stop_text) :]
        return self._closer

    def _generation_prompt(self) -> str | None:
        """The generation prompt, when the template always appends the same text for it; else None.

        Checked on a few conversation shapes; a template whose prompt depends on the conversation
        (a thinking switch, say) is rendered in full each time instead.
        """
        probes = [
            [Message(role="user", content="x")],
            [Message(role="system", content="s"), Message(role="user", content="x"),
             Message(role="assistant", content="y"), Message(role="tool", content="z", name="t")],
            [Message(role="user", content="x"), Message(role="assistant", content="y"),
             Message(role="user", content="w")],
        ]
        suffixes = set()
        for probe in probes:
            try:
                plain, prompted = self._render(probe, False), self._render(probe, True)
            except Exception:  # a template that refuses a probe shape: no shortcut, render in full
                return None
            if not prompted.startswith(plain):
                return None
            suffixes.add(prompted[len(plain):])
        return suffixes.pop() if len(suffixes) == 1 else None

    def _assistant_closer(self) -> str:
        """What the template writes after an assistant message's content (`<|im_end|>\\n` for ChatML)."""
        text = self._render(
            [Message(role="user", content="x"), Message(role="assistant", content=_PROBE)], add_generation_prompt=False
        )
        if _PROBE not in text:
            raise ValueError("the chat template does not render assistant messages' content; cannot keep their tokens")
        return text.split(_PROBE, 1)[1]
