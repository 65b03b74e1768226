"""The OpenAI-compatible endpoint over real HTTP, with scripted model replies: sessions, token
bookkeeping, limits and every kind of bad input. (`test_real_agents.py` runs real agent SDKs
against a real engine.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from transformers import AutoTokenizer

from envs.calculator import demo_replies
from slime_async.agents import AgentEnv, close_shared_server, shared_server
from slime_async.env import EnvFactory, EnvLoadError, Limits, Sampling, ScriptedPolicy, reward, run_episode
from slime_async.types import StopReason, Task, Trajectory


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def play(tokenizer: Any, agent: str, replies: list[str], task: Task | None = None, **kwargs: Any) -> Trajectory:
    limits = kwargs.pop("limits", None)
    name = agent if ":" in agent else f"blackbox_agents:{agent}"
    env = AgentEnv(AgentEnv.Args(agent=name, **({"limits": limits} if limits else {})))
    task = task or Task(id="t", prompt="What is 12*34+5?", answer=413, metadata={"answers": []})
    try:
        return await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer, **kwargs)
    finally:
        await close_shared_server()


def probe_task(*requests: Any, **extra: Any) -> Task:
    return Task(id="p", prompt="hi", metadata={"requests": list(requests), "answers": [], **extra})


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **fields}


async def test_each_call_is_recorded_token_exactly_and_only_replies_train(tokenizer: Any) -> None:
    task = Task(id="c", prompt="What is 12*34+5?", answer=413, metadata={})
    replies = demo_replies(Task(id="c", prompt="", answer=413, metadata={"steps": ["12*34+5"]}))
    traj = await play(tokenizer, "openai_calculator", replies, task)
    assert traj.stop_reason is StopReason.DONE and traj.rewards == {"agent": 1.0}, traj.error
    assert len(traj.turns) == 2 and traj.metrics["tool_calls"] == 1 and traj.metrics["new_branches"] == 0
    for turn, reply in zip(traj.turns, replies, strict=True):  # exactly the (scripted) server's ids
        expected = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        assert turn.completion_ids.tolist() == expected
    _, _, mask = traj.flat()
    completions: set[int] = set()  # positions of the completion tokens
    pos = 0
    for t in traj.turns:
        pos += len(t.prompt_ids)
        completions |= set(range(pos, pos + len(t.completion_ids)))
        pos += len(t.completion_ids)
    assert set(np.flatnonzero(mask).tolist()) == completions
    tool_turn = tokenizer.decode(traj.turns[1].prompt_ids.tolist(), skip_special_tokens=False)
    assert "<tool_response>413</tool_response>" in tool_turn  # the agent's tool result, as a tool message
    assert task.metadata["messages"][-1]["content"] == "The answer is 413."


async def test_the_agents_conversation_is_the_envs_token_for_token(tokenizer: Any) -> None:
    env = EnvFactory.from_config("envs.calculator:CalculatorEnv", {"demo_tool_fraction": 0.5})
    agent = EnvFactory.from_config("envs.calculator_agent:CalculatorAgentEnv", {"demo_tool_fraction": 0.5})
    try:
        for task in list(env.tasks("train"))[:12]:
            script = env.cls.demonstration(env.args, task)
            a = await run_episode(env.new(), task, ScriptedPolicy(script, tokenizer), tokenizer)
            b = await run_episode(agent.new(), task, ScriptedPolicy(script, tokenizer), tokenizer)
            assert [x.tolist() for x in a.flat()] == [x.tolist() for x in b.flat()]
            assert (a.reward, a.stop_reason) == (b.reward, b.stop_reason) and b.rewards == {"agent": a.reward}
    finally:
        await close_shared_server()


async def test_an_agent_that_rewrites_history_starts_a_new_segment(tokenizer: Any) -> None:
    traj = await play(tokenizer, "rewriting", ["a", "b", "c"])
    assert traj.stop_reason is StopReason.DONE and traj.metrics["new_branches"] == 1
    assert [t.new_branch for t in traj.turns] == [False, True, False]
    _, second = traj.segments()
    assert tokenizer.decode(second[0].tolist()).count("something else") == 1  # the whole edited context
    assert tokenizer.decode(second[0].tolist()).endswith("more<|im_end|>\n<|im_start|>assistant\nc<|im_end|>")


async def test_n_samples_are_each_recorded_and_continuing_one_is_a_segment(tokenizer: Any) -> None:
    task = Task(id="n", prompt="hi", metadata={})
    traj = await play(tokenizer, "two_samples", ["x", "y", "z"], task)
    assert task.metadata["choices"] == 2 and len(traj.turns) == 3
    # sample 1 is a segment of its own; the agent continued sample 0, which the session no longer held
    assert [t.new_branch for t in traj.turns] == [False, True, True]
    assert traj.turns[1].prompt_ids.tolist() == traj.turns[0].prompt_ids.tolist()


async def test_a_plain_def_agent_runs_in_a_thread(tokenizer: Any) -> None:
    traj = await play(tokenizer, "sync_calculator", ['<tool_call>{"name": "calculate", "arguments": {}}</tool_call>'])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 0.5


async def test_the_turn_limit_ends_the_episode_and_the_agent_is_told(tokenizer: Any) -> None:
    task = Task(id="m", prompt="hi", metadata={})
    traj = await play(tokenizer, "chatty", ["a"] * 10, task, limits=Limits(max_turns=3))
    assert traj.stop_reason is StopReason.MAX_TURNS and len(traj.turns) == 3
    assert "episode is over (max_turns)" in task.metadata["refusal"]


async def test_the_token_budget_clamps_and_then_ends_the_episode(tokenizer: Any) -> None:
    task = Task(id="m", prompt="hi", metadata={})
    traj = await play(tokenizer, "chatty", ["word " * 40] * 10, task, limits=Limits(max_total_tokens=40))
    assert traj.stop_reason is StopReason.MAX_TOKENS
    assert sum(len(t.prompt_ids) + len(t.completion_ids) for t in traj.turns) <= 40


@pytest.mark.parametrize("agent, reason, error", [
    ("crashing", StopReason.ENV_ERROR, "the agent raised RuntimeError: the agent fell over"),
    ("returns_text", StopReason.ENV_ERROR, "the agent returned 'great'"),
])  # fmt: skip
async def test_a_failing_agent_ends_its_episode_with_the_reason(tokenizer: Any, agent: str, reason: StopReason,
                                                                error: str) -> None:
    traj = await play(tokenizer, agent, [])
    assert traj.stop_reason is reason and error in traj.error


async def test_an_agent_that_never_returns_times_out_and_its_session_is_released(tokenizer: Any) -> None:
    task = probe_task()
    traj = await play(tokenizer, "hanging", [], task, limits=Limits(episode_timeout_s=0.5))
    assert traj.stop_reason is StopReason.EPISODE_TIMEOUT
    server = await shared_server()
    try:
        assert server.sessions == {}
        async with aiohttp.ClientSession() as http, http.post(
                task.metadata["base_url"].replace(task.metadata["base_url"].split("/s/")[0], server.url)
                + "/chat/completions", json=chat(), headers={"Authorization": f"Bearer {task.metadata['key']}"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_session"
    finally:
        await close_shared_server()


async def test_the_callers_stop_aborts_a_waiting_agent(tokenizer: Any) -> None:
    stop = asyncio.Event()
    env = AgentEnv(AgentEnv.Args(agent="blackbox_agents:hanging"))
    try:
        episode = asyncio.ensure_future(run_episode(env, probe_task(), ScriptedPolicy([], tokenizer), tokenizer,
                                                    stop=stop))
        while not (await shared_server()).sessions:
            await asyncio.sleep(0.01)
        stop.set()
        traj = await asyncio.wait_for(episode, 10)
    finally:
        await close_shared_server()
    assert traj.stop_reason is StopReason.ABORTED and "stopped by the caller" in traj.error


BAD = [
    ("{not json", "the body is not JSON"),
    (chat(response_format={"type": "json_object"}), "unknown field `response_format`"),
    (chat(tool_choice="required"), "tool_choice: only 'auto' and 'none'"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(presence_penalty=0.5), "presence_penalty"),
    (chat(n=100), "Expected `int` <= 16 - at `$.n`"),
    (chat(temperature=-1), "$.temperature"),
    (chat(max_tokens=8, max_completion_tokens=9), "max_tokens and max_completion_tokens differ"),
    (chat(parallel_tool_calls=False), "parallel_tool_calls"),
    ({"model": "policy", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role: 'robot'"),
    ({"model": "policy", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]: only text parts"),
    ({"model": "policy", "messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     "messages[1]: the last message is the assistant's"),
    ({"model": "policy", "messages": []}, "messages: empty"),
    ({"model": "policy", "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}, {"role": "user"}]},
     "messages[0].tool_calls[0].function.arguments: not JSON"),
]


async def test_bad_requests_get_a_400_that_names_the_field_and_the_session_goes_on(tokenizer: Any) -> None:
    task = probe_task(*[body for body, _ in BAD], chat(max_tokens=4))
    traj = await play(tokenizer, "probe", ["fine"], task)
    answers = task.metadata["answers"]
    for (body, expected), (status, answer) in zip(BAD, answers, strict=False):
        assert status == 400 and expected in answer["error"]["message"], (body, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    status, good = answers[-1]
    assert status == 200 and good["choices"][0]["message"]["content"] == "fine"
    assert traj.stop_reason is StopReason.DONE and len(traj.turns) == 1  # nothing bad was recorded


async def test_a_wrong_key_or_unknown_session_is_refused(tokenizer: Any) -> None:
    wrong_key = probe_task(chat(), key="sk-wrong")
    await play(tokenizer, "probe", [], wrong_key)
    assert wrong_key.metadata["answers"][0][0] == 401
    server = await shared_server()
    try:
        unknown = probe_task(chat(), url=f"{server.url}/s/nosuchsession/v1")
        await play(tokenizer, "probe", [], unknown)
        assert unknown.metadata["answers"][0][0] == 404
    finally:
        await close_shared_server()


async def test_stop_strings_are_trimmed_from_the_text_but_kept_in_the_tokens(tokenizer: Any) -> None:
    task = probe_task(chat(stop=["END"], seed=3, logprobs=True), chat(stream=True))
    traj = await play(tokenizer, "probe", ["done END"], task)
    status, answer = task.metadata["answers"][0]
    assert status == 200 and answer["choices"][0]["message"]["content"] == "done "
    assert answer["choices"][0]["logprobs"]["content"][0]["logprob"] == 0.0
    assert "END" in tokenizer.decode(traj.turns[0].completion_ids.tolist())
    assert answer["usage"]["completion_tokens"] == len(traj.turns[0].completion_ids)


async def test_models_lists_the_policy() -> None:
    server = await shared_server()
    try:
        async with aiohttp.ClientSession() as http, http.get(server.url + "/v1/models") as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["policy"]
    finally:
        await close_shared_server()


def test_a_wrong_agent_name_is_an_error_of_the_config() -> None:
    with pytest.raises(EnvLoadError, match=r"agent: cannot import module 'no_such_module'"):
        EnvFactory.from_config("envs.openai_agent:AgentEnv", {"agent": "no_such_module:run"})
    with pytest.raises(EnvLoadError, match=r"agent: required"):
        EnvFactory.from_config("envs.openai_agent:AgentEnv", {})
    with pytest.raises(EnvLoadError, match=r"must take \(task, base_url, api_key\)"):
        EnvFactory.from_config("envs.openai_agent:AgentEnv", {"agent": "json:dumps"})


async def test_sampling_fields_reach_the_policy(tokenizer: Any) -> None:
    seen: list[Sampling] = []

    class Recording(ScriptedPolicy):
        async def generate(self, input_ids: Any, sampling: Sampling) -> Any:
            seen.append(sampling)
            return await super().generate(input_ids, sampling)

    env = AgentEnv(AgentEnv.Args(agent="blackbox_agents:probe"))
    task = probe_task(chat(temperature=0.3, top_p=0.5, max_completion_tokens=7, stop="x", seed=11))
    try:
        await run_episode(env, task, Recording(["a"], tokenizer), tokenizer, sampling=Sampling(max_new_tokens=20))
    finally:
        await close_shared_server()
    assert msgspec.structs.asdict(seen[0]) == {**msgspec.structs.asdict(Sampling()), "temperature": 0.3, "top_p": 0.5,
                                               "max_new_tokens": 7, "stop": ["x"], "sampling_seed": 11}
    assert json.loads(json.dumps(seen[0].to_sglang()))["stop"] == ["x"]


class VerifiedAgentEnv(AgentEnv):
    """An agent env whose own verifier scores the final answer, beside what the agent returns."""

    @reward(inline=True)
    def says_answer(self, completion: str, answer: Any, messages: list) -> float:
        return float(completion == f"The answer is {answer}." and messages[-2].role == "tool")


async def test_the_envs_own_rewards_score_the_agents_final_reply(tokenizer: Any) -> None:
    task = Task(id="c", prompt="What is 12*34+5?", answer=413, metadata={})
    replies = demo_replies(Task(id="c", prompt="", answer=413, metadata={"steps": ["12*34+5"]}))
    env = VerifiedAgentEnv(VerifiedAgentEnv.Args(agent="blackbox_agents:openai_calculator"))
    try:
        traj = await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer)
    finally:
        await close_shared_server()
    assert traj.rewards == {"says_answer": 1.0, "agent": 1.0} and traj.reward == 2.0
