"""Turns rendered from skeletons give exactly the token ids of full renders of the whole
conversation (the tiny model's real template, with and without tools, tool messages and the
generation prompt, and the bundled envs' episodes); templates a skeleton cannot stand in for are
caught and rendered in full."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slime_async.env.episode_loop as episode_module
import slime_async.env.renderer as renderer_module
from slime_async.env import HermesParser, Renderer, ScriptedPolicy, run_episode
from slime_async.env.template import facts_for
from slime_async.types import Message, ToolCall

TEXT = st.text(alphabet=st.sampled_from(list("abcxyz 0123456789+-*/=.,:'\"\n{}[]\\é中")), max_size=30).map(str.strip)
CALL = st.builds(
    lambda name, args: ToolCall(name=name, arguments=args),
    st.sampled_from(["calculate", "search"]),
    st.dictionaries(st.sampled_from(["expression", "k"]), st.one_of(TEXT, st.integers(-99, 999)), max_size=2),
)
TOOL = st.builds(lambda c, i, n: Message(role="tool", content=c, tool_call_id=i, name=n),
                 TEXT, st.one_of(st.none(), st.just("call_1")), st.one_of(st.none(), st.just("calculate")))
ENV_TURN = st.one_of(st.lists(TOOL, min_size=1, max_size=3), TEXT.map(lambda x: [Message(role="user", content=x)]))
TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "math", "parameters": {}}}]


@pytest.fixture
def unverified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skeletons used from their first use on: a wrong one shows, instead of being caught."""
    monkeypatch.setattr(renderer_module, "VERIFY_USES", 0)


@pytest.fixture(scope="module")
def fresh(tokenizer: Any) -> Any:
    """A copy of the tokenizer: its template facts start empty (they are kept per tokenizer object)."""
    return copy.deepcopy(tokenizer)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.one_of(st.none(), TEXT),
    first=TEXT,
    steps=st.lists(st.tuples(TEXT, st.lists(CALL, max_size=2), ENV_TURN, st.booleans()), min_size=1, max_size=4),
    with_tools=st.booleans(),
)
def test_skeleton_turns_equal_full_renders(
    fresh: Any, unverified: None, system: str | None, first: str, steps: list, with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    fast, full = Renderer(fresh, tools=tools), Renderer(fresh, tools=tools, incremental=False)
    messages = ([Message(role="system", content=system)] if system else []) + [Message(role="user", content=first)]
    assert fast.start(messages) == full.start(messages)
    parser = HermesParser()
    for content, calls, env_messages, stop in steps:
        ids = fresh.encode(parser.format(content, calls), add_special_tokens=False)
        completion = [*ids, fresh.eos_token_id] if stop else ids
        for r in (fast, full):
            parsed = r.parse(completion)
            reply = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
            r.add_completion(completion, reply)
        assert fast.extend(env_messages) == full.extend(env_messages)
        assert fast.ids == full.ids
    assert fast.facts.skeletons and all(s is None or s.good for s in fast.facts.skeletons.values())


BUNDLED = [  # (env, its args, the module function that writes a correct episode's replies, if not its own)
    ("envs.calculator:CalculatorEnv", {}, None),
    ("envs.calculator:CalculatorEnv", {"variant": "two_step", "show_tool_schemas": True}, None),
    ("envs.guess_number:GuessNumberEnv", {}, None),
    ("envs.search:SearchEnv", {}, "envs.search:demo_replies"),
]


@pytest.mark.parametrize(("env_path", "args", "demo"), BUNDLED)
async def test_bundled_envs_episodes_equal_full_renders(
    fresh: Any, unverified: None, monkeypatch: pytest.MonkeyPatch, env_path: str, args: dict[str, Any], demo: str | None
) -> None:
    import importlib

    from slime_async.env import EnvFactory

    factory = EnvFactory.from_config(env_path, args)
    tasks = list(factory.tasks("train"))[:4]
    if demo is not None:
        module, name = demo.split(":")
        replies_of = getattr(importlib.import_module(module), name)
    else:
        replies_of = functools.partial(factory.cls.demonstration, factory.args)

    async def play(task: Any) -> Any:
        replies = replies_of(task)
        return await run_episode(factory.new(), task, ScriptedPolicy(replies, fresh), fresh)

    fast = [await play(t) for t in tasks]
    monkeypatch.setattr(episode_module, "Renderer", functools.partial(Renderer, incremental=False))
    reference = [await play(t) for t in tasks]
    for a, b in zip(fast, reference, strict=True):
        assert len(a.turns) == len(b.turns) >= 2  # at least one environment turn was rendered
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert list(ta.prompt_ids) == list(tb.prompt_ids) and list(ta.completion_ids) == list(tb.completion_ids)
        assert a.reward == b.reward
    env = factory.new()
    used = facts_for(fresh, (env.tool_schemas() if env.show_tools else None) or None).skeletons.values()
    assert any(s is not None for s in used)  # the fast path ran, not only the full one


def _edited(tokenizer: Any, old: str, new: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, new)
    return tok


def _conversation(renderer: Renderer, tokenizer: Any, replies: list[tuple[str, list[Message]]]) -> list[int]:
    renderer.start([Message(role="user", content="q")])
    for text, env_messages in replies:
        completion = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        renderer.add_completion(completion, Message(role="assistant", content=text))
        renderer.extend(env_messages)
    return renderer.ids


REPLIES = [("a", [Message(role="tool", content=" padded ")]), ("b", [Message(role="tool", content="x")]),
           ("c", [Message(role="tool", content="y")]), ("d", [Message(role="tool", content="z")])]


def test_template_that_transforms_words_gets_no_skeleton(tokenizer: Any, unverified: None) -> None:
    tok = _edited(tokenizer, "<tool_response>{{ message.content }}", "<tool_response>{{ message.content | trim }}")
    fast = _conversation(Renderer(tok), tok, REPLIES)
    assert fast == _conversation(Renderer(tok, incremental=False), tok, REPLIES)
    tool_shapes = [s for k, s in facts_for(tok, None).skeletons.items() if k[2] and k[2][0][0] == "tool"]
    assert tool_shapes and all(s is None for s in tool_shapes)


def test_template_looking_past_the_window_is_caught_by_verification(tokenizer: Any) -> None:
    """The tool response numbers itself by its place in the whole conversation: the stand-in window
    gives another number, the first full-render check sees it, and that shape renders in full."""
    tok = _edited(tokenizer, "<tool_response>{{ message.content }}",
                  "<tool_response>{{ loop.index }}:{{ message.content }}")
    fast = _conversation(Renderer(tok), tok, REPLIES)
    assert fast == _conversation(Renderer(tok, incremental=False), tok, REPLIES)
    assert any(s is not None and not s.good for s in facts_for(tok, None).skeletons.values())


def test_history_rewriting_template_gets_no_skeletons(tokenizer: Any) -> None:
    tok = _edited(tokenizer, "{{ message.content if message.content is string else '' }}",
                  "{{ message.content if loop.last else message.content.split('</think>')[-1] }}")
    assert not facts_for(tok, None).append_only
    assert facts_for(tokenizer, None).append_only


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 881), max_size=40))
def test_facts_decode_like_the_tokenizer(tokenizer: Any, ids: list[int]) -> None:
    facts = facts_for(tokenizer, None)
    assert facts._decoder is not None  # the shortcut is taken for the tiny model's tokenizer
    assert facts.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert facts.stop_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
