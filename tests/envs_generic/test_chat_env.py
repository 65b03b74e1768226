"""ChatEnv episodes with scripted replies through the real tokenizer and renderer: single- and multi-turn."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from envs.chat import ChatArgs, ChatEnv
from slime_async.env import EnvFactory, ScriptedPolicy, VerifierPool, run_episode
from slime_async.types import Message, StopReason, Task


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_single_turn_math_from_config_args(tokenizer) -> None:
    factory = EnvFactory.from_config("envs.chat:ChatEnv", {"verifier": "math", "system_prompt": "Box the answer."})
    task = Task(id="t", prompt="What is 1/2 + 1/4?", answer="3/4")
    good = await run_episode(factory.new(), task, ScriptedPolicy(["It is \\boxed{0.75}"], tokenizer), tokenizer)
    bad = await run_episode(factory.new(), task, ScriptedPolicy(["It is \\boxed{1}"], tokenizer), tokenizer)
    assert good.stop_reason == StopReason.DONE and good.reward == 1.0 and len(good.turns) == 1
    assert bad.reward == 0.0 and bad.metrics["attempts_used"] == 1.0
    assert "Box the answer." in tokenizer.decode(good.turns[0].prompt_ids)


async def test_multi_turn_retries_until_right_or_out_of_attempts(tokenizer) -> None:
    args = ChatArgs(verifier="exact", max_attempts=3)
    task = Task(id="t", prompt=[Message(role="user", content="Capital of France?")], answer="Paris")
    policy = ScriptedPolicy(["The answer is Rome.", "The answer is Paris."], tokenizer)
    t = await run_episode(ChatEnv(args), task, policy, tokenizer)
    assert t.reward == 1.0 and len(t.turns) == 2 and t.metrics["attempts_used"] == 2.0
    assert "Try again" in tokenizer.decode(t.turns[1].prompt_ids)  # the retry message is env tokens
    wrong = ScriptedPolicy(["The answer is Rome."] * 3, tokenizer)
    t = await run_episode(ChatEnv(args), task, wrong, tokenizer)
    assert t.reward == 0.0 and len(t.turns) == 3 and t.stop_reason == StopReason.DONE


async def test_a_missing_label_counts_a_reward_error_not_a_crash(tokenizer) -> None:
    task = Task(id="t", prompt="Say hi.")
    t = await run_episode(ChatEnv(), task, ScriptedPolicy(["hi"], tokenizer), tokenizer)
    assert t.reward == 0.0 and t.metrics["reward_errors"] == 1.0 and "no label" in t.error


async def test_math_verify_runs_in_the_verifier_pool(tokenizer) -> None:
    task = Task(id="t", prompt="2+2?", answer="4")
    with VerifierPool(workers=1) as pool:
        t = await run_episode(ChatEnv(ChatArgs(verifier="math")), task, ScriptedPolicy(["\\boxed{4}"], tokenizer),
                              tokenizer, verifiers=pool)
    assert t.reward == 1.0
