"""Exact tokenization of rendered chat text at a fraction of the cost: split at special tokens,
remember the pieces.

A HF fast tokenizer first cuts its input at its added tokens (`<|im_start|>`, `<tool_response>`,
...) and tokenizes each piece between them on its own: normalizer, pre-tokenizer and model never
see across such a cut. So the ids of a text are the ids of its pieces, in order, with each added
token's id between them. Chat text is mostly the same few pieces (`user\\n`, `assistant\\n`,
`\\n`) around a few new words, and a tokenizer call costs 4-5 us even for one word (50 us for a
turn's tool response, about a tenth of a turn's CPU): a `PieceEncoder` calls the tokenizer once per
piece it has not seen, and never for a special token.

It cuts only where the tokenizer is sure to cut (`PieceEncoder.build` checks the added tokens:
plain, not normalized, none able to overlap another's start), and is used only after it agreed
with the tokenizer itself on probe texts; otherwise the tokenizer encodes the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MAX_CACHED = 8192
"""Pieces remembered per encoder; past that the cache starts over (new words should not pile up)."""
_AWKWARD = (" ", "  x ", "x", "\n", "\n\n", " \n", "é中", "'s", "a b", "1+2=3", "\t", "<", ">", "<|", "|>")


class PieceEncoder:
    """`encode(text)` gives `tokenizer.encode(text, add_special_tokens=False).ids`, piece by piece."""

    def __init__(self, fast: Any, split_tokens: dict[str, int]) -> None:
        self._fast = fast
        self._ids = split_tokens
        # Longest first, so that of two tokens starting at one place the longer one wins (as the
        # tokenizer's leftmost-longest matching does; `build` rules such pairs out anyway).
        self._split = re.compile("|".join(re.escape(t) for t in sorted(split_tokens, key=len, reverse=True)))
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def build(cls, fast: Any, probes: Iterable[str] = ()) -> PieceEncoder | None:
        """An encoder for the `tokenizers.Tokenizer` `fast`, or None when cutting at its added tokens
        is not certain to give its own ids (checked on `probes` and on awkward texts around every
        added token)."""
        try:
            added = list(fast.get_added_tokens_decoder().items())
        except Exception:  # not a `tokenizers.Tokenizer`: nothing to rely on
            return None
        first_pass = [(i, t) for i, t in added if not t.normalized]
        if any(t.lstrip or t.rstrip or t.single_word for _, t in first_pass):
            return None  # tokens that eat the whitespace around them: pieces are not independent
        texts = [t.content for _, t in first_pass]
        split = {}
        for token_id, token in first_pass:
            s = token.content
            # The tokenizer cuts at every occurrence of `s` when no added token can match over its
            # first character from further left, and none starts with `s` and is longer.
            if s and not any(s[0] in t[1:] for t in texts) and not any(t != s and t.startswith(s) for t in texts):
                split[s] = token_id
        if not split:
            return None
        encoder = cls(fast, split)
        samples = [*probes, *_around(list(split))]
        try:
            agree = all(encoder.encode(text) == fast.encode(text, add_special_tokens=False).ids for text in samples)
        except Exception:
            return None
        encoder._cache.clear()  # keep the probes' words out of the cache
        return encoder if agree else None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in self._split.finditer(text):
            start = m.start()
            if start > pos:
                out += self._piece(text[pos:start])
            out.append(self._ids[m.group()])
            pos = m.end()
        if pos < len(text):
            out += self._piece(text[pos:])
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            ids = self._cache[piece] = self._fast.encode(piece, add_special_tokens=False).ids
        return ids


def _around(tokens: list[str]) -> list[str]:
    """Texts that put every split token next to awkward neighbours: spaces, newlines, other tokens,
    the token itself, parts of it."""
    out = []
    for t in tokens:
        for a in _AWKWARD:
            out += [a + t, t + a, a + t + a, t + a + t]
        out += [t + t, t[:-1], t[1:], t[:-1] + t, t + t[1:], "x" + t[: len(t) // 2] + t]
        out += [t + u + " y\n" for u in tokens]
    return out
