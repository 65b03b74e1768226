"""The renderer with the tiny model's real tokenizer and chat template: the conversation's tokens
only ever grow by appending, the server's tokens are kept exactly, and a template that rewrites
history starts a new branch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_async.env import HermesParser, Renderer
from slime_async.types import Message, ToolCall

# No '<' (markup is generated on purpose, not by chance); text already NFC and stripped, as the
# parser returns content stripped and the tokenizer normalises to NFC.
TEXT = st.text(alphabet=st.sampled_from(list("abcxyz 0123456789+-*/=.,:'\"\n{}[]é中")), max_size=30).map(str.strip)
CALL = st.builds(
    lambda name, args: ToolCall(name=name, arguments=args),
    st.sampled_from(["calculate", "search", "run_python"]),
    st.dictionaries(st.sampled_from(["expression", "query", "k"]), st.one_of(TEXT, st.integers(-99, 999)), max_size=2),
)
ASSISTANT = st.tuples(TEXT, st.lists(CALL, max_size=3))
ENV_TURN = st.one_of(
    st.lists(TEXT, min_size=1, max_size=3).map(lambda xs: [Message(role="tool", content=x) for x in xs]),
    TEXT.map(lambda x: [Message(role="user", content=x)]),
)


def _completion(tokenizer: Any, text: str, stop: bool) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [*ids, tokenizer.eos_token_id] if stop else ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.one_of(st.none(), TEXT),
    first=TEXT,
    steps=st.lists(st.tuples(ASSISTANT, ENV_TURN, st.booleans()), min_size=1, max_size=4),
    with_tools=st.booleans(),
)
def test_tokens_only_grow_and_match_the_template(
    tokenizer: Any, system: str | None, first: str, steps: list, with_tools: bool
) -> None:
    tools = [{"type": "function", "function": {"name": "calculate", "description": "math", "parameters": {}}}]
    renderer = Renderer(tokenizer, tools=tools if with_tools else None)
    messages = ([Message(role="system", content=system)] if system else []) + [Message(role="user", content=first)]
    ids = renderer.start(messages)
    parser = HermesParser()
    for (content, calls), env_messages, stop in steps:
        before = list(renderer.ids)
        text = parser.format(content, calls)
        completion = _completion(tokenizer, text, stop)
        parsed = renderer.parse(completion)
        assert parsed.content == content
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in calls]
        message = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
        renderer.add_completion(completion, message)
        assert renderer.ids == before + completion  # the server's tokens, exactly
        delta = renderer.extend(copy.deepcopy(env_messages))
        assert not delta.new_branch
        assert renderer.ids == before + completion + delta.ids  # turn k is a prefix of turn k+1
        ids = renderer.ids
    # The kept tokens are what the template would have produced for the whole conversation.
    full_text = renderer.render(renderer.messages, add_generation_prompt=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == full_text
    assert ids == tokenizer.encode(full_text, add_special_tokens=False)


def test_length_cut_reply_gets_the_whole_turn_end(tokenizer: Any) -> None:
    renderer = Renderer(tokenizer)
    renderer.start([Message(role="user", content="hi")])
    completion = _completion(tokenizer, "partial answ", stop=False)
    renderer.add_completion(completion, Message(role="assistant", content="partial answ"))
    delta = renderer.extend([Message(role="user", content="go on")])
    assert tokenizer.decode(delta.ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )


def test_server_tokens_kept_even_when_not_canonical(tokenizer: Any) -> None:
    """A model may spell a text with other tokens than the tokenizer would; those ids stay."""
    renderer = Renderer(tokenizer)
    renderer.start([Message(role="user", content="hi")])
    odd = [*tokenizer.encode("4", add_special_tokens=False), *tokenizer.encode("2", add_special_tokens=False)]
    odd += [tokenizer.eos_token_id]
    renderer.add_completion(odd, Message(role="assistant", content="42"))
    before = list(renderer.ids)
    renderer.extend([Message(role="user", content="and?")])
    assert renderer.ids[: len(before)] == before


# A template that drops earlier reasoning (as Qwen3's does): it is not append-only.
def _rewriting_template(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    original = "{{ message.content if message.content is string else '' }}"
    assert original in tok.chat_template
    tok.chat_template = tok.chat_template.replace(
        original, "{{ message.content if loop.last else message.content.split('</think>')[-1] }}"
    )
    return tok


def test_template_that_rewrites_history_starts_a_new_branch(tokenizer: Any) -> None:
    tok = _rewriting_template(tokenizer)
    renderer = Renderer(tok)
    renderer.start([Message(role="user", content="q")])
    completion = _completion(tok, "<think>hmm</think>42", stop=True)
    renderer.add_completion(completion, Message(role="assistant", content="<think>hmm</think>42"))
    delta = renderer.extend([Message(role="user", content="sure?")])
    assert delta.new_branch
    full_text = renderer.render(renderer.messages, add_generation_prompt=True)
    assert "hmm" not in full_text
    assert delta.ids == renderer.ids == tok.encode(full_text, add_special_tokens=False)


def test_same_template_without_rewrite_stays_on_branch(tokenizer: Any) -> None:
    tok = _rewriting_template(tokenizer)
    renderer = Renderer(tok)
    renderer.start([Message(role="user", content="q")])
    completion = _completion(tok, "42", stop=True)
    renderer.add_completion(completion, Message(role="assistant", content="42"))
    assert not renderer.extend([Message(role="user", content="sure?")]).new_branch


def test_tokenizer_without_template_is_refused(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Renderer(tok)


def test_constant_generation_prompt_is_found_once_and_matches_full_rendering(tokenizer: Any) -> None:
    """The shortcut (render without the prompt, append it) must give exactly what the template gives."""
    import copy

    renderer = Renderer(tokenizer)
    assert renderer._gen_prompt == "<|im_start|>assistant\n"
    conversation = [Message(role="user", content="2+3?"), Message(role="assistant", content="", tool_calls=[]),
                    Message(role="tool", content="5", name="calculate")]
    assert renderer.render(conversation, True) == renderer._render(conversation, True)
    # a template whose prompt depends on the conversation gets no shortcut
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = odd.chat_template.replace(
        "{%- if add_generation_prompt %}<|im_start|>assistant\n",
        "{%- if add_generation_prompt %}<|im_start|>assistant{{ messages|length }}\n")
    assert odd.chat_template != tokenizer.chat_template
    assert Renderer(odd)._gen_prompt is None
