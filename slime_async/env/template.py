"""What a chat template does, worked out once per (tokenizer, tools), so that a turn costs no Jinja.

Rendering the whole conversation through the template (`apply_chat_template`) costs about 70 us
and the renderer needed two renders a turn: with tokenization that was most of an episode's CPU
on the rollout side. Two observations make a turn almost free instead:

- The text a turn appends depends on the *shape* of the new messages (roles, which fields are set,
  whether the content is empty) and of the messages just before them, not on their words: the
  words are copied verbatim. So the template is rendered once per shape with placeholders in
  the new messages' fields (a `Skeleton`), and a turn substitutes the real strings.
- The context a template looks at when it renders new messages is local (the previous message's
  role, whether there is a system message): a short window of stand-in messages of the same
  shapes (the same `[base + new] - [base]` trick as other RL stacks) gives the same new text.

Neither is true of every template, so nothing is assumed: a skeleton is used only after
(a) substituting awkward strings (spaces at the ends, quotes, backslashes, braces, newlines)
reproduces the template's own rendering of them exactly (no escaping, trimming, or other
transforms of the words), and (b) its first `VERIFY_USES` uses agreed with a full render of the
real conversation. A skeleton failing either is never used again (a full render each time). A
template that rewrites history (drops earlier reasoning, like Qwen3's) gets no skeletons at all:
its new branches need the whole conversation.

Tokenizing the text a turn appends goes piece by piece between special tokens, each piece
tokenized once (`slime_async.env.pieces`), where that is sure to give the tokenizer's own ids.
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from typing import Any

import msgspec

from slime_async.env.pieces import PieceEncoder
from slime_async.types import Message, ToolCall

log = logging.getLogger(__name__)

VERIFY_USES = 3
"""Uses of each skeleton checked against a full render of the real conversation before it is trusted."""
_PROBE = "\x00slime-probe\x00"
_HOLE = re.compile("\x00(\\d+)\x00")
_AWKWARD = ' a "b" \\c {d} {{e}} {%f%}\n\tg é中 '
"""Substitution test value: a template that trims, escapes or re-formats words renders it differently."""
_WINDOW = 2
"""Messages before the new ones that a skeleton's stand-in context copies the shapes of."""

Shape = tuple[str, bool, int, bool, bool]


def shape(m: Message) -> Shape:
    """What a template may branch on, besides the words: role, content empty or not, number of
    calls, and which optional fields are set."""
    return (m.role, m.content != "", len(m.tool_calls), m.tool_call_id is not None, m.name is not None)


class Skeleton:
    """A rendering with holes: literal text and indices of the strings to put in."""

    __slots__ = ("good", "parts", "uses")

    def __init__(self, parts: list[str | int]) -> None:
        self.parts = parts
        self.uses = 0
        self.good = True

    def fill(self, values: list[str]) -> str:
        return "".join(p if isinstance(p, str) else values[p] for p in self.parts)


class TemplateFacts:
    """Per (tokenizer, tools): the assistant closer, the generation prompt, whether the template is
    append-only, the skeletons, and the fastest exact way to tokenize. Get one with `facts_for`."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.closer = self._assistant_closer()
        self.gen_prompt = self._generation_prompt()
        self.append_only = self.gen_prompt is not None and self._append_only()
        """Skeletons are used only then; otherwise every turn renders the whole conversation."""
        self.skeletons: dict[tuple[Any, ...], Skeleton | None] = {}
        """None: this shape cannot be a skeleton (new assistant calls, a refused rendering)."""
        self.stop_texts: dict[int, str] = {}
        self.stop_ids = _stop_ids(tokenizer)
        """Token ids that end a generation (the server includes the one that matched)."""
        self._fast = self._fast_tokenizer()
        self._pieces = PieceEncoder.build(self._fast, self._probe_texts()) if self._fast is not None else None
        self._decoder = getattr(tokenizer, "_tokenizer", None) if _decodes_plainly(tokenizer) else None

    # ---- rendering and tokenizing ------------------------------------------------------------

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_chat() for m in messages], tools=self.tools, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )  # fmt: skip

    def encode(self, text: str) -> list[int]:
        """Special tokens in the text are recognised as such; no BOS/EOS is added around it."""
        if self._pieces is not None:  # new pieces only, never the template's own (see `pieces`)
            return self._pieces.encode(text)
        if self._fast is not None:  # the Rust tokenizer itself: the same ids, without ~15 us of wrapper
            return self._fast.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included, as `tokenizer.decode` gives it."""
        if self._decoder is not None:  # what the wrapper would call, without its ~4 us of argument handling
            return self._decoder.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def stop_text(self, token: int) -> str:
        if token not in self.stop_texts:
            self.stop_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self.stop_texts[token]

    # ---- skeletons ---------------------------------------------------------------------------

    def skeleton(self, context: list[Message], new: list[Message]) -> tuple[Skeleton, list[str]] | None:
        """The skeleton of the text that `new` (plus the generation prompt) appends after `context`,
        and the strings to fill it with; None when this needs a full render."""
        if not self.append_only or any(m.tool_calls for m in new):
            return None  # the words of a tool call go through tojson: not copied verbatim
        if context and context[-1].role != "assistant":
            return None  # only turns after a reply are checked for being append-only (`_append_only`)
        window = ([context[0]] if context and context[0].role == "system" else []) + context[-_WINDOW:]
        if len(window) > 1 and window[0] is window[1]:
            window = window[1:]
        gap = len(context) > len(window)  # messages left out between the system one and the window
        key = (tuple(map(shape, window)), gap, tuple(map(shape, new)))
        if key not in self.skeletons:
            self.skeletons[key] = self._build(window, new)
        skeleton = self.skeletons[key]
        if skeleton is None or not skeleton.good:
            return None
        return skeleton, [v for m in new for v in _fields(m)]

    def _build(self, window: list[Message], new: list[Message]) -> Skeleton | None:
        stand_ins = [_stand_in(m) for m in window]
        try:
            base = self.render(stand_ins, False) if stand_ins else ""
            holes = self._render_new(stand_ins, new, lambda i, v: f"\x00{i}\x00")
            awkward = self._render_new(stand_ins, new, lambda i, v: f"{_AWKWARD}{i}{_AWKWARD}")
        except Exception:  # a template that refuses the stand-ins: full renders for this shape
            return None
        if not holes.startswith(base) or not awkward.startswith(base):
            return None
        pieces = _HOLE.split(holes[len(base):])
        parts: list[str | int] = [p if i % 2 == 0 else int(p) for i, p in enumerate(pieces)]
        skeleton = Skeleton([p for p in parts if p != ""])
        values = [f"{_AWKWARD}{i}{_AWKWARD}" for i in range(sum(len(_fields(m)) for m in new))]
        if skeleton.fill(values) != awkward[len(base):]:
            return None  # the template transforms the words (escapes, trims): not a skeleton
        return skeleton

    def _render_new(self, stand_ins: list[Message], new: list[Message], value: Any) -> str:
        counter = iter(range(1 << 30))
        filled = [_with_fields(m, [value(next(counter), v) for v in _fields(m)]) for m in new]
        return self.render(stand_ins + filled, False) + (self.gen_prompt or "")

    def rejected(self, skeleton: Skeleton) -> None:
        if skeleton.good:
            log.warning("a chat-template skeleton disagreed with the full render; that message shape is "
                        "rendered in full from now on")
        skeleton.good = False

    # ---- facts, checked once -----------------------------------------------------------------

    def _fast_tokenizer(self) -> Any:
        """The backing `tokenizers.Tokenizer` when calling it directly gives what `encode` gives."""
        fast = getattr(self.tokenizer, "_tokenizer", None)
        if fast is None or not hasattr(fast, "encode") or getattr(self.tokenizer, "split_special_tokens", False):
            return None
        if getattr(fast, "truncation", None) is not None or getattr(fast, "padding", None) is not None:
            return None
        probe = self.render([Message(role="user", content="x 1+2 é"), Message(role="assistant", content="y")], True)
        try:
            same = fast.encode(probe, add_special_tokens=False).ids == list(
                self.tokenizer.encode(probe, add_special_tokens=False))
        except Exception:
            return None
        return fast if same else None

    def _probe_texts(self) -> list[str]:
        """Renderings of the probe conversations (whole, and each one's last message alone), to
        check a tokenizing shortcut against the tokenizer on the template's own text."""
        out = []
        for probe in _PROBES:
            for messages in (probe, probe[-1:]):
                with contextlib.suppress(Exception):  # a template refusing a shape: fewer probes
                    out += [self.render(messages, False), self.render(messages, True)]
        return out

    def _generation_prompt(self) -> str | None:
        """The generation prompt, when the template always appends the same text for it; else None.

        Checked on a few conversation shapes; a template whose prompt depends on the conversation
        (a thinking switch, say) is rendered in full each time instead.
        """
        suffixes = set()
        for probe in _PROBES:
            try:
                plain, prompted = self.render(probe, False), self.render(probe, True)
            except Exception:  # a template that refuses a probe shape: no shortcut, render in full
                return None
            if not prompted.startswith(plain):
                return None
            suffixes.add(prompted[len(plain):])
        return suffixes.pop() if len(suffixes) == 1 else None

    def _append_only(self) -> bool:
        """Whether each probe conversation's rendering up to a reply is a prefix of its
        continuation's (Qwen3's template, which drops earlier reasoning, is not)."""
        for probe in _PROBES:
            for cut in [i + 1 for i, m in enumerate(probe[:-1]) if m.role == "assistant"]:
                try:
                    if not self.render(probe, False).startswith(self.render(probe[:cut], False)):
                        return False
                except Exception:
                    return False
        return True

    def _assistant_closer(self) -> str:
        """What the template writes after an assistant message's content (`<|im_end|>\\n` for ChatML)."""
        text = self.render(
            [Message(role="user", content="x"), Message(role="assistant", content=_PROBE)], add_generation_prompt=False
        )
        if _PROBE not in text:
            raise ValueError("the chat template does not render assistant messages' content; cannot keep their tokens")
        return text.split(_PROBE, 1)[1]


def _stop_ids(tokenizer: Any) -> frozenset[int]:
    candidates = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return frozenset(i for i in candidates if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id)


def _decodes_plainly(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=False)` is its Rust tokenizer's decode and
    nothing more: transformers' own fast-tokenizer `decode`, not overridden, without the clean-up
    of spaces."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the wrapper
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces)


def _fields(m: Message) -> list[str]:
    """The strings of a message that a template copies: content (when not empty), call id, name."""
    return [v for v in (m.content or None, m.tool_call_id, m.name) if v is not None]


def _with_fields(m: Message, values: list[str]) -> Message:
    it = iter(values)
    return msgspec.structs.replace(
        m, content=next(it) if m.content else "",
        tool_call_id=next(it) if m.tool_call_id is not None else None,
        name=next(it) if m.name is not None else None,
    )  # fmt: skip


def _stand_in(m: Message) -> Message:
    """A message of the same shape as `m` with made-up words."""
    return Message(
        role=m.role, content="x" if m.content else "",
        tool_calls=[ToolCall(name="f", arguments={}, id=f"call_{i}") for i in range(len(m.tool_calls))],
        tool_call_id="call_0" if m.tool_call_id is not None else None, name="t" if m.name is not None else None,
    )  # fmt: skip


_CALL = ToolCall(name="calculate", arguments={"expression": "1+2"}, id="call_0")
_PROBES = [
    [Message(role="user", content="x")],
    [Message(role="system", content="s"), Message(role="user", content="x"),
     Message(role="assistant", content="<think>r</think>y", tool_calls=[_CALL]),
     Message(role="tool", content="z", name="t", tool_call_id="call_0"), Message(role="tool", content="w", name="t"),
     Message(role="assistant", content="v")],
    [Message(role="user", content="x"), Message(role="assistant", content="<think>r</think>y"),
     Message(role="user", content="w"), Message(role="assistant", content="v")],
]  # fmt: skip

_FACTS: weakref.WeakKeyDictionary[Any, dict[str, TemplateFacts]] = weakref.WeakKeyDictionary()
"""Per tokenizer object (weakly: a dropped tokenizer's facts go with it), per tools."""


def facts_for(tokenizer: Any, tools: list[dict[str, Any]] | None) -> TemplateFacts:
    """The template facts of `tokenizer` with `tools`, worked out on first use."""
    key = msgspec.json.encode(tools).decode()
    try:
        per_tools = _FACTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: no sharing across episodes
        return TemplateFacts(tokenizer, tools)
    if key not in per_tools:
        per_tools[key] = TemplateFacts(tokenizer, tools)
    return per_tools[key]
