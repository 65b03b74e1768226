"""The piece encoder gives exactly the tokenizer's ids (any text around special tokens), and is
refused for tokenizers whose added tokens could make a cut wrong."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_async.env import pieces as pieces_module
from slime_async.env.pieces import PieceEncoder
from slime_async.env.template import TemplateFacts

SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
            "<think>", "</think>", "<|endoftext|>"]
BITS = st.one_of(st.sampled_from(SPECIALS), st.sampled_from(["<", "|>", "<|im_", "_end|>", "tool", "/"]),
                 st.text(alphabet=st.sampled_from(list("ab xyz019+*\n\t'é中<>|_")), max_size=8))


@pytest.fixture(scope="module")
def fast(tokenizer: Any) -> Any:
    return tokenizer._tokenizer


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(BITS, max_size=12).map("".join))
def test_same_ids_as_the_tokenizer(fast: Any, text: str) -> None:
    encoder = PieceEncoder.build(fast)
    assert encoder is not None
    assert encoder.encode(text) == fast.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == fast.encode(text, add_special_tokens=False).ids  # from the cache too


def test_template_facts_encode_with_it(tokenizer: Any) -> None:
    facts = TemplateFacts(tokenizer, None)
    assert facts._pieces is not None
    text = "<|im_start|>user\n 12 é<tool_response>x</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert facts.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert facts._pieces._cache  # it went through the pieces


def test_the_cache_is_bounded(fast: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces_module, "MAX_CACHED", 4)
    encoder = PieceEncoder.build(fast)
    assert encoder is not None
    for i in range(20):
        assert encoder.encode(f"<|im_start|>{i}<|im_end|>") == fast.encode(f"<|im_start|>{i}<|im_end|>",
                                                                          add_special_tokens=False).ids
        assert len(encoder._cache) <= 4


def test_refused_when_an_added_token_could_overlap_a_cut(fast: Any) -> None:
    overlapping = copy.deepcopy(fast)
    overlapping.add_special_tokens(["ab<|im"])  # matches across the start of `<|im_start|>`
    encoder = PieceEncoder.build(overlapping)
    assert encoder is None or "<|im_start|>" not in encoder._ids
    text = "xab<|im_start|>user"
    if encoder is not None:
        assert encoder.encode(text) == overlapping.encode(text, add_special_tokens=False).ids


def test_refused_when_tokens_strip_whitespace(fast: Any) -> None:
    from tokenizers import AddedToken

    stripping = copy.deepcopy(fast)
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    assert PieceEncoder.build(stripping) is None


class _Contextual:
    """A tokenizer whose ids depend on where a text starts (like a `first`-only prefix space):
    cutting changes them, and the probe check must see it."""

    def __init__(self, fast: Any) -> None:
        self.fast = fast

    def get_added_tokens_decoder(self) -> Any:
        return self.fast.get_added_tokens_decoder()

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        ids = self.fast.encode(text, add_special_tokens=False).ids
        return type("E", (), {"ids": [7, *ids]})()


def test_refused_when_the_probes_disagree(fast: Any) -> None:
    assert PieceEncoder.build(_Contextual(fast)) is None
