"""Real agent code against a real embedded engine, through the endpoint: the `openai` SDK (async,
streaming; chat completions and responses), the OpenAI Agents SDK, the `anthropic` SDK. What they
record must be what the engine generated."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from helpers import post
from transformers import AutoTokenizer

from slime_async.agents import close_shared_server
from slime_async.env import EnvFactory, Sampling
from slime_async.launch.process import EngineProcess
from slime_async.rollout.client import SGLangClient
from slime_async.rollout.scheduler import HttpPolicy, Scheduler
from slime_async.types import Group, StopReason, Task, Trajectory

pytestmark = pytest.mark.slow
GREEDY = Sampling(temperature=0.0, max_new_tokens=48)


@pytest.fixture(scope="module")
def tokenizer(tool_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tool_model_dir)


async def episode(engine: EngineProcess, tokenizer: Any, task: Task, agent: str, **args: Any) -> Trajectory:
    factory = EnvFactory.from_config("envs.calculator_agent:CalculatorAgentEnv", {"agent": agent, **args})
    try:
        async with SGLangClient([engine.url]) as client:
            return await factory.episode(task, HttpPolicy(client, "e"), tokenizer, sampling=GREEDY)
    finally:
        await close_shared_server()


async def assert_engine_generated(engine: EngineProcess, traj: Trajectory, segments: bool = False) -> None:
    """Every turn's tokens and logprobs are what the engine gives for that context (greedy), and the
    loss mask covers exactly the generated tokens. A turn that starts a new segment (allowed with
    `segments`) has the whole context as its prompt."""
    context: list[int] = []
    for turn in traj.turns:
        assert segments or not turn.new_branch
        context = (context if not turn.new_branch else []) + turn.prompt_ids.tolist()
        n = len(turn.completion_ids)
        status, answer = await post(engine.url, "/generate", {
            "input_ids": context, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n}})  # fmt: skip
        assert status == 200
        assert answer["output_ids"] == turn.completion_ids.tolist()
        expected = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(turn.logprobs, expected, atol=1e-4)
        assert turn.versions.tolist() == [0] * n and turn.loss_mask.tolist() == [1] * n
        context += turn.completion_ids.tolist()
    pieces = traj.segments()
    assert pieces[-1][0].tolist() == context and len(pieces) == 1 + sum(t.new_branch for t in traj.turns)
    assert sum(int(mask.sum()) for _, _, mask in pieces) == traj.num_completion_tokens


async def test_the_openai_sdk_agent_trains_on_exactly_what_the_engine_generated(
        tool_engine: EngineProcess, tokenizer: Any, calc_tasks: list[Task]) -> None:  # fmt: skip
    for task in calc_tasks[:3]:
        traj = await episode(tool_engine, tokenizer, task, "envs.calculator_agent:run")
        assert traj.stop_reason is StopReason.DONE, traj.error
        assert traj.metrics["tool_calls"] >= 1 and len(traj.turns) >= 2
        await assert_engine_generated(tool_engine, traj)
        # the agent's own tool ran, and its result reached the model as a tool message
        result = tokenizer.decode(traj.turns[1].prompt_ids.tolist())
        assert "<tool_response>" in result and "</tool_response>" in result
    assert traj.rewards == {"agent": traj.reward}


async def test_the_openai_agents_sdk_agent_runs_unchanged(tool_engine: EngineProcess, tokenizer: Any,
                                                         calc_tasks: list[Task]) -> None:
    task = Task(id=calc_tasks[0].id, prompt=calc_tasks[0].prompt, answer=calc_tasks[0].answer, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "blackbox_agents:agents_sdk_calculator")
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert traj.metrics["tool_calls"] >= 1 and traj.metrics["new_branches"] == 0
    await assert_engine_generated(tool_engine, traj)
    reply = tokenizer.decode(traj.turns[-1].completion_ids.tolist(), skip_special_tokens=True)
    assert task.metadata["final_output"] == reply  # what the SDK's runner returned is the model's last reply
    assert str(task.answer) in tokenizer.decode(traj.turns[1].prompt_ids.tolist())  # its tool's result


@pytest.mark.parametrize("agent", ["anthropic_calculator", "responses_calculator"])
async def test_each_apis_sdk_agent_trains_on_exactly_what_the_engine_generated(
        tool_engine: EngineProcess, tokenizer: Any, calc_tasks: list[Task], agent: str) -> None:  # fmt: skip
    task = Task(id=calc_tasks[1].id, prompt=calc_tasks[1].prompt, answer=calc_tasks[1].answer, metadata={})
    traj = await episode(tool_engine, tokenizer, task, f"blackbox_agents:{agent}")
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert traj.metrics["tool_calls"] >= 1 and len(traj.turns) >= 2 and traj.metrics["new_branches"] == 0
    await assert_engine_generated(tool_engine, traj)
    assert f"<tool_response>{task.answer}</tool_response>" in tokenizer.decode(traj.turns[1].prompt_ids.tolist())
    # what the SDK handed the agent is the model's last reply
    assert task.metadata["final"] == tokenizer.decode(traj.turns[-1].completion_ids.tolist(), skip_special_tokens=True)


async def test_a_langgraph_react_agent_trains_on_exactly_what_the_engine_generated(
        tool_engine: EngineProcess, tokenizer: Any, calc_tasks: list[Task]) -> None:  # fmt: skip
    task = Task(id=calc_tasks[2].id, prompt=calc_tasks[2].prompt, answer=calc_tasks[2].answer, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "framework_agents:langgraph_calculator")
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert traj.metrics["tool_calls"] >= 1 and traj.metrics["new_branches"] == 0
    await assert_engine_generated(tool_engine, traj)
    assert f"<tool_response>{task.answer}</tool_response>" in tokenizer.decode(traj.turns[1].prompt_ids.tolist())
    kinds = [kind for kind, _ in task.metadata["messages"]]
    assert kinds[:3] == ["human", "ai", "tool"] and kinds[-1] == "ai"  # the graph ran the tool node
    assert task.metadata["messages"][-1][1] == tokenizer.decode(traj.turns[-1].completion_ids.tolist(),
                                                                skip_special_tokens=True)


async def test_a_smolagents_tool_calling_agent_trains_each_rewritten_context_as_a_segment(
        tool_engine: EngineProcess, tokenizer: Any, calc_tasks: list[Task]) -> None:  # fmt: skip
    task = Task(id=calc_tasks[0].id, prompt=calc_tasks[0].prompt, answer=calc_tasks[0].answer, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "framework_agents:smolagents_calculator")
    # the tiny model never saw smolagents' prompts: its last reply may run to the token limit (truncated,
    # as the endpoint said "length"); anything else is a failure of ours
    assert traj.stop_reason in (StopReason.DONE, StopReason.TRUNCATED) and not traj.error, traj.error
    assert len(traj.turns) >= 2 and all(t.new_branch for t in traj.turns[1:])  # its memory, replayed as text
    await assert_engine_generated(tool_engine, traj, segments=True)
    assert task.metadata["steps"][:2] == ["TaskStep", "ActionStep"]
    # each later call's prompt is the whole context again, smolagents' memory as it words it (the tiny
    # model, trained on the calculator's prompts, does not call the tool here: test_docs.py's scripted
    # smolagents episode checks the tool's result coming back as "Observation:")
    for turn in traj.turns[1:]:
        assert tokenizer.decode(turn.prompt_ids.tolist()).count(f"New task:\n{task.prompt}") == 1


async def test_streamed_anthropic_messages_assemble_to_the_plain_ones(tool_engine: EngineProcess, tokenizer: Any,
                                                                     calc_tasks: list[Task]) -> None:
    task = Task(id="s", prompt=calc_tasks[0].prompt, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "blackbox_agents:anthropic_streaming")
    plain, streamed = task.metadata["plain"], task.metadata["streamed"]
    assert plain["stop_reason"] == "tool_use" and plain["content"][0]["name"] == "calculate"
    assert plain["content"][0]["input"] == {"expression": calc_tasks[0].metadata["steps"][0]}
    assert plain.pop("id") != streamed.pop("id") and plain["content"][0].pop("id") != streamed["content"][0].pop("id")
    assert streamed == plain  # blocks, tool input (joined from input_json_delta), stop reason, usage
    assert {"message_start", "input_json", "content_block_stop", "message_stop"} <= set(task.metadata["events"])
    assert streamed["usage"]["output_tokens"] == len(traj.turns[1].completion_ids)


async def test_streamed_responses_assemble_to_the_plain_ones(tool_engine: EngineProcess, tokenizer: Any,
                                                             calc_tasks: list[Task]) -> None:
    task = Task(id="s", prompt=calc_tasks[0].prompt, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "blackbox_agents:responses_streaming")
    plain, streamed = task.metadata["plain"], task.metadata["streamed"]
    (call,) = plain["output"]
    assert call["type"] == "function_call" and call["name"] == "calculate" and plain["status"] == "completed"
    for r in (plain, streamed):  # fresh ids each call
        r.pop("id"), r.pop("created_at"), r["output"][0].pop("id"), r["output"][0].pop("call_id")
    assert streamed["output"][0].pop("parsed_arguments") is None  # what the SDK's stream helper adds
    assert streamed == plain  # items, arguments (from the argument deltas), status, usage
    assert {"response.created", "response.function_call_arguments.delta", "response.completed"} <= set(
        task.metadata["events"])
    assert streamed["usage"]["output_tokens"] == len(traj.turns[1].completion_ids)


async def test_streamed_replies_assemble_to_the_plain_ones(tool_engine: EngineProcess, tokenizer: Any,
                                                          calc_tasks: list[Task]) -> None:
    task = Task(id="s", prompt=calc_tasks[0].prompt, metadata={})
    traj = await episode(tool_engine, tokenizer, task, "blackbox_agents:streaming_calculator")
    plain, streamed = task.metadata["plain"], task.metadata["streamed"]
    assert plain["finish"] == "tool_calls" and plain["calls"][0]["name"] == "calculate"
    assert all(c.pop("id").startswith("call_") for c in plain["calls"] + streamed["calls"])  # one per call
    assert {k: streamed[k] for k in ("content", "finish", "calls")} == plain
    assert streamed["usage"]["completion_tokens"] == len(traj.turns[1].completion_ids)


async def test_groups_of_agent_episodes_go_through_the_scheduler(tool_engine: EngineProcess, tokenizer: Any) -> None:
    class ListSink:
        def __init__(self) -> None:
            self.groups: list[Group] = []

        async def put(self, group: list[Trajectory]) -> None:
            self.groups.append(Group(group_id=group[0].group_id, task_id=group[0].task_id, trajectories=group))

        async def close(self) -> None:
            pass

    factory = EnvFactory.from_config("envs.calculator_agent:CalculatorAgentEnv")
    sink = ListSink()
    try:
        async with SGLangClient([tool_engine.url]) as client:
            scheduler = Scheduler(factory, factory.tasks("train"), client, tokenizer, sink, group_size=4, batch_size=8,
                                  filter_equal_rewards=False, sampling=Sampling(temperature=1.0, max_new_tokens=48))
            stats = await scheduler.run(num_groups=3)
    finally:
        await close_shared_server()
    assert stats.balanced() and stats.sent + sum(stats.dropped.values()) == 12
    for group in sink.groups:
        assert len({t.group_id for t in group.trajectories}) == 1 and len(group.trajectories) == 4
        for t in group.trajectories:
            assert t.num_completion_tokens > 0 and t.min_version() == 0


async def wait_for_waiting(url: str, timeout_s: float = 30) -> None:
    """Wait (bounded) until the paused engine holds a request (as SGLang does, before looking at it)."""
    for _ in range(int(timeout_s / 0.02)):
        if (await server_info(url))["internal_states"][0]["num_held_reqs"] >= 1:
            return
        await asyncio.sleep(0.02)
    pytest.fail("the agent's call never reached the engine")


async def server_info(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url + "/get_server_info") as resp:
        return await resp.json()


async def test_a_call_during_a_weight_update_waits_for_it(tool_engine: EngineProcess, tokenizer: Any,
                                                         calc_tasks: list[Task]) -> None:
    url = tool_engine.url
    assert (await post(url, "/pause_generation", {"mode": "abort"}))[0] == 200
    try:
        running = asyncio.ensure_future(episode(tool_engine, tokenizer, calc_tasks[0], "envs.calculator_agent:run"))
        await wait_for_waiting(url)
        assert not running.done()  # it waits for the update, it does not fail
        assert (await post(url, "/update_weight_version", {"new_version": "1"}))[0] == 200
    finally:
        assert (await post(url, "/continue_generation", {}))[0] == 200
    try:
        traj = await asyncio.wait_for(running, 60)
    finally:
        await post(url, "/update_weight_version", {"new_version": "0"})
    assert traj.stop_reason is StopReason.DONE, traj.error
    assert {int(v) for t in traj.turns for v in t.versions} == {1}  # every token from the new weights
