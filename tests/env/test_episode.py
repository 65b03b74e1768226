"""run_episode end to end with the tiny model's tokenizer: tools, bad input, every limit and
policy, rewards, teardown. Hanging things wait on events that never fire, so a timeout is the
only way out: no test depends on how fast this machine is."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Annotated, Any

import msgspec
import numpy as np
import pytest

from slime_async.env import (
    Env,
    Generation,
    Injected,
    Limits,
    ParseErrorPolicy,
    Renderer,
    Sampling,
    ScriptedPolicy,
    ToolError,
    metric,
    reward,
    run_episode,
    tool,
)
from slime_async.types import Message, StopReason, Task

TASK = Task(id="t1", prompt="What is 2+3?", answer=5)


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + msgspec.json.encode({"name": name, "arguments": arguments}).decode() + "</tool_call>"


class ToyEnv(Env):
    def __init__(self, args: Any = None) -> None:
        super().__init__(args)
        self.events: list[str] = []
        self.active = self.peak = 0
        self.thread: int | None = None

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        self.thread = threading.get_ident()
        return a + b

    @tool
    async def hang(self) -> str:
        await asyncio.Event().wait()
        return "never"

    @tool
    def boom(self) -> str:
        raise RuntimeError("kaboom")

    @tool
    def refuse(self) -> str:
        raise ToolError("not allowed here")

    @tool
    def big(self) -> str:
        return "x" * 2_000_000

    @tool
    def whoami(self, task: Annotated[Task, Injected]) -> dict[str, Any]:
        return {"task": task.id}

    @tool
    async def slow(self, i: int) -> int:
        self.active += 1
        self.peak = max(self.peak, self.active)
        for _ in range(3):
            await asyncio.sleep(0)
        self.active -= 1
        return i

    @tool
    def submit(self, answer: int) -> str:
        self.finish()
        return "ok"

    @reward(weight=2.0)
    def correct(self, completion: str, answer: Any) -> float:
        return float(completion.strip() == str(answer))

    @metric
    def answer_chars(self, completion: str) -> float:
        return len(completion)

    async def setup(self, task: Task) -> None:
        self.events.append("setup")

    async def teardown(self) -> None:
        self.events.append("teardown")


def limits(**kw: Any) -> Limits:
    return Limits(**kw)


async def play(
    tokenizer: Any, replies: list[str], env: Env | None = None, **kw: Any
) -> tuple[Any, Env, ScriptedPolicy]:
    env = env or ToyEnv()
    policy = ScriptedPolicy(replies, tokenizer)
    traj = await run_episode(env, TASK, policy, tokenizer, **kw)
    return traj, env, policy


def tool_messages(env: Env) -> list[str]:
    return [m.content for m in env.messages_seen if m.role == "tool"]  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _record_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep each episode's final conversation on its env, for the assertions."""
    from slime_async.env import episode_loop

    original = episode_loop._Episode._score

    async def score(self: Any) -> None:
        self.env.messages_seen = self.renderer.messages if self.renderer else []
        await original(self)

    monkeypatch.setattr(episode_loop._Episode, "_score", score)


async def test_solved_with_a_tool_call(tokenizer: Any) -> None:
    traj, env, policy = await play(tokenizer, [call("add", a=2, b=3), "5"])
    assert traj.stop_reason is StopReason.DONE
    assert traj.rewards == {"correct": 1.0} and traj.reward == 2.0
    assert traj.metrics["answer_chars"] == 1.0
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1
    assert tool_messages(env) == ["5"]
    assert env.events == ["setup", "teardown"]
    assert env.thread is not None and env.thread != threading.get_ident()  # sync tools run in a thread
    # Token bookkeeping: the second call's input extends the first call's input and output.
    first_in, second_in = policy.seen
    t0, t1 = traj.turns
    assert second_in == first_in + list(t0.completion_ids) + list(t1.prompt_ids)
    assert "<tool_response>5</tool_response>" in tokenizer.decode(t1.prompt_ids)
    ids, logprobs, mask = traj.flat()
    assert not logprobs.any()  # scripted: logprob 0 everywhere
    assert list(ids) == second_in + list(t1.completion_ids)
    assert mask.sum() == len(t0.completion_ids) + len(t1.completion_ids)
    assert list(mask[: len(first_in)]) == [0] * len(first_in)
    assert traj.turns[0].finish_reason == "stop" and set(traj.turns[0].versions) == {0}


async def test_wrong_answer_scores_zero(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, [call("add", a=2, b=2), "4"])
    assert traj.stop_reason is StopReason.DONE and traj.reward == 0.0


@pytest.mark.parametrize(
    ("reply", "counter", "message"),
    [
        (call("nope", x=1), "unknown_tools", "error: unknown tool 'nope'; the tools are: add, hang, boom"),
        (
            call("add", a="2", b=3),
            "bad_tool_args",
            "error: bad arguments for add: Expected `int`, got `str` - at `$.a`",
        ),
        (call("add", a=2), "bad_tool_args", "error: bad arguments for add: Object missing required field `b`"),
        (call("boom"), "tool_errors", "error: boom raised RuntimeError: kaboom"),
        (call("refuse"), "tool_errors", "error: not allowed here"),
        (call("hang"), "tool_timeouts", "error: hang timed out after 0.05 s"),
    ],
)
async def test_bad_tool_calls_become_messages_and_counts(
    tokenizer: Any, reply: str, counter: str, message: str
) -> None:
    traj, env, _ = await play(tokenizer, [reply, "5"], limits=limits(tool_timeout_s=0.05))
    assert traj.stop_reason is StopReason.DONE and traj.reward == 2.0  # the episode goes on
    assert traj.metrics[counter] == 1
    (content,) = tool_messages(env)
    assert content.startswith(message)


async def test_huge_tool_output_is_truncated(tokenizer: Any) -> None:
    traj, env, _ = await play(tokenizer, [call("big"), "5"], limits=limits(max_tool_output_chars=100))
    (content,) = tool_messages(env)
    assert content == "x" * 100 + "\n[... 1999900 more characters cut]"
    assert traj.metrics["tool_outputs_truncated"] == 1


async def test_injected_argument_and_json_result(tokenizer: Any) -> None:
    _, env, _ = await play(tokenizer, [call("whoami"), "5"])
    assert tool_messages(env) == ['{"task":"t1"}']


async def test_parallel_tool_calls_are_bounded_and_ordered(tokenizer: Any) -> None:
    reply = "\n".join(call("slow", i=i) for i in range(5))
    traj, env, _ = await play(tokenizer, [reply, "5"], limits=limits(max_parallel_tools=2))
    assert tool_messages(env) == ["0", "1", "2", "3", "4"]
    assert env.peak == 2  # type: ignore[attr-defined]
    assert traj.metrics["tool_calls"] == 5


async def test_a_tool_can_end_the_episode(tokenizer: Any) -> None:
    traj, _, policy = await play(tokenizer, [call("submit", answer=5), "unused"])
    assert traj.stop_reason is StopReason.DONE and policy.calls == 1


async def test_max_turns(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, [call("add", a=1, b=1)] * 3, limits=limits(max_turns=2))
    assert traj.stop_reason is StopReason.MAX_TURNS and len(traj.turns) == 2


async def test_max_tool_calls(tokenizer: Any) -> None:
    traj, env, _ = await play(
        tokenizer, [call("add", a=1, b=1) + call("add", a=1, b=2)], limits=limits(max_tool_calls=1)
    )
    assert traj.stop_reason is StopReason.MAX_TOOL_CALLS
    assert tool_messages(env) == [] and traj.metrics["tool_calls"] == 0


async def test_token_budget_clamps_and_ends(tokenizer: Any) -> None:
    prompt_len = len(
        Renderer(tokenizer, tools=ToyEnv().tool_schemas()).start([Message(role="user", content=str(TASK.prompt))])
    )
    traj, _, _ = await play(tokenizer, ["a long answer " * 10], limits=limits(max_total_tokens=prompt_len + 4))
    assert traj.stop_reason is StopReason.MAX_TOKENS
    assert len(traj.turns[0].completion_ids) == 4 and traj.turns[0].finish_reason == "length"
    traj, _, _ = await play(tokenizer, ["5"], limits=limits(max_total_tokens=prompt_len))
    assert traj.stop_reason is StopReason.MAX_TOKENS and traj.turns == []


async def test_reply_cut_by_max_new_tokens_is_truncated(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, ["a long answer " * 10], sampling=Sampling(max_new_tokens=3))
    assert traj.stop_reason is StopReason.TRUNCATED and len(traj.turns[0].completion_ids) == 3


class HangingPolicy:
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        self.entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("lim", "reason"),
    [
        (Limits(turn_timeout_s=0.05), StopReason.TURN_TIMEOUT),
        (Limits(episode_timeout_s=0.05), StopReason.EPISODE_TIMEOUT),
        (Limits(turn_timeout_s=100, episode_timeout_s=0.05), StopReason.EPISODE_TIMEOUT),
    ],
)
async def test_wall_clock_limits(tokenizer: Any, lim: Limits, reason: StopReason) -> None:
    env = ToyEnv()
    traj = await run_episode(env, TASK, HangingPolicy(), tokenizer, limits=lim)
    assert traj.stop_reason is reason
    assert env.events == ["setup", "teardown"]
    assert traj.rewards == {"correct": 0.0}  # scored: a timeout is the model's doing


async def test_turn_timeout_during_tools_keeps_the_generated_turn(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, [call("hang")], limits=limits(turn_timeout_s=0.05, tool_timeout_s=100))
    assert traj.stop_reason is StopReason.TURN_TIMEOUT and len(traj.turns) == 1


async def test_cancellation_runs_teardown_and_propagates(tokenizer: Any) -> None:
    env, policy = ToyEnv(), HangingPolicy()
    task = asyncio.ensure_future(run_episode(env, TASK, policy, tokenizer))
    await policy.entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.events == ["setup", "teardown"]


async def test_stop_event_aborts_with_a_trajectory(tokenizer: Any) -> None:
    env, policy, stop = ToyEnv(), HangingPolicy(), asyncio.Event()
    task = asyncio.ensure_future(run_episode(env, TASK, policy, tokenizer, stop=stop))
    await policy.entered.wait()
    stop.set()
    traj = await task
    assert traj.stop_reason is StopReason.ABORTED and traj.rewards == {}
    assert env.events == ["setup", "teardown"]


async def test_one_stop_event_serves_many_episodes_and_a_reuse(tokenizer: Any) -> None:
    """Episodes share one waiter per stop event: one that ends normally must not take it away from
    (or abort) another still waiting for its model, and an event cleared after a stop works again.
    (The 10 s guard only turns a hang into a failure.)"""
    stop = asyncio.Event()
    for _ in range(2):
        env, policy = ToyEnv(), HangingPolicy()
        waiting = asyncio.ensure_future(run_episode(env, TASK, policy, tokenizer, stop=stop))
        await policy.entered.wait()
        done, _, _ = await play(tokenizer, ["5"], stop=stop)  # ends normally meanwhile
        assert done.stop_reason is StopReason.DONE
        for _ in range(5):
            await asyncio.sleep(0)  # let a wrongly woken episode run to its end
        assert not waiting.done()
        stop.set()
        traj = await asyncio.wait_for(waiting, 10)
        assert traj.stop_reason is StopReason.ABORTED
        stop.clear()


class StopDuringTool(ToyEnv):
    """Sets the stop event from inside a tool call, then finishes the tool after a few loop turns."""

    def __init__(self, stop: asyncio.Event) -> None:
        super().__init__()
        self.stop = stop

    @tool
    async def sets_stop(self) -> str:
        self.stop.set()
        for _ in range(5):
            await asyncio.sleep(0)  # a wrongly delivered cancellation would land here
        self.events.append("tool finished")
        return "ok"


async def test_a_stop_during_a_tool_lets_it_finish_and_aborts_at_the_next_model_call(tokenizer: Any) -> None:
    stop = asyncio.Event()
    env = StopDuringTool(stop)
    policy = ScriptedPolicy([call("sets_stop"), "5"], tokenizer)
    traj = await run_episode(env, TASK, policy, tokenizer, stop=stop)
    assert env.events == ["setup", "tool finished", "teardown"]
    assert traj.stop_reason is StopReason.ABORTED and policy.calls == 1 and len(traj.turns) == 1


class StubbornPolicy:
    """Finishes its call even when cancelled (a policy that must not lose tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.entered = asyncio.Event()
        self.scripted = ScriptedPolicy(["5"], tokenizer)

    async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
        self.entered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return await self.scripted.generate(input_ids, sampling)


async def test_a_stop_into_a_call_that_swallows_it_aborts_and_leaves_no_pending_cancel(tokenizer: Any) -> None:
    stop, policy = asyncio.Event(), StubbornPolicy(tokenizer)
    task = asyncio.ensure_future(run_episode(ToyEnv(), TASK, policy, tokenizer, stop=stop))
    await policy.entered.wait()
    stop.set()
    traj = await task
    assert traj.stop_reason is StopReason.ABORTED and traj.turns == []  # as any call the stop caught
    assert task.cancelling() == 0


async def test_a_cancellation_with_a_stop_still_propagates(tokenizer: Any) -> None:
    env, policy, stop = ToyEnv(), HangingPolicy(), asyncio.Event()
    task = asyncio.ensure_future(run_episode(env, TASK, policy, tokenizer, stop=stop))
    await policy.entered.wait()
    stop.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.events == ["setup", "teardown"]


class FailingSetup(ToyEnv):
    async def setup(self, task: Task) -> None:
        self.events.append("setup")
        raise ConnectionError("no database")


class FailingTeardown(ToyEnv):
    async def teardown(self) -> None:
        raise OSError("disk gone")


class Simulator(ToyEnv):
    async def on_reply(self, message: Message) -> list[Message] | None:
        if message.content == "5":
            return None
        if message.content == "crash":
            raise KeyError("user model")
        return [Message(role="user", content="Try again.")]


async def test_setup_failure_is_env_error(tokenizer: Any) -> None:
    traj, env, policy = await play(tokenizer, ["5"], env=FailingSetup())
    assert traj.stop_reason is StopReason.ENV_ERROR
    assert traj.error == "setup failed: ConnectionError: no database"
    assert traj.reward == 0.0 and traj.turns == [] and policy.calls == 0
    assert env.events == ["setup", "teardown"]


async def test_teardown_failure_is_counted(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, ["5"], env=FailingTeardown())
    assert traj.stop_reason is StopReason.DONE and traj.metrics["teardown_errors"] == 1


async def test_on_reply_user_simulator(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, ["4", "5"], env=Simulator())
    assert traj.stop_reason is StopReason.DONE and len(traj.turns) == 2
    assert "Try again." in tokenizer.decode(traj.turns[1].prompt_ids)
    traj, _, _ = await play(tokenizer, ["crash"], env=Simulator())
    assert traj.stop_reason is StopReason.ENV_ERROR and "KeyError" in traj.error


async def test_server_errors(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, [call("add", a=1, b=1)])  # the script runs out: the "server" fails
    assert traj.stop_reason is StopReason.SERVER_ERROR and "ScriptExhausted" in traj.error
    assert len(traj.turns) == 1 and traj.rewards == {}

    class Aborting:
        async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
            return Generation(completion_ids=[5], logprobs=[-1.0], versions=[3], finish_reason="abort")

    traj = await run_episode(ToyEnv(), TASK, Aborting(), tokenizer)
    assert traj.stop_reason is StopReason.ABORTED and list(traj.turns[0].versions) == [3]


BAD = "<tool_call>{not json}</tool_call>"


async def test_parse_error_feedback_penalty_and_mask(tokenizer: Any) -> None:
    policy_value = ParseErrorPolicy(penalty=-0.5, mask_bad_turn=True)
    traj, env, _ = await play(tokenizer, [BAD, "5"], limits=limits(parse_errors=policy_value))
    assert traj.stop_reason is StopReason.DONE
    (content,) = tool_messages(env)
    assert content.startswith("error: tool call 1: invalid JSON")
    assert traj.metrics["parse_errors"] == 1
    assert traj.rewards == {"correct": 1.0, "parse_error": -0.5} and traj.reward == 1.5
    assert traj.turns[0].loss_mask.sum() == 0 and traj.turns[1].loss_mask.all()


async def test_parse_errors_give_up(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, [BAD, BAD, "5"], limits=limits(parse_errors=ParseErrorPolicy(max_consecutive=2)))
    assert traj.stop_reason is StopReason.PARSE_ERROR and len(traj.turns) == 2
    assert traj.turns[0].loss_mask.all()  # not masked unless asked
    traj, _, _ = await play(tokenizer, [BAD, "5"], limits=limits(parse_errors=ParseErrorPolicy(feedback=False)))
    assert traj.stop_reason is StopReason.PARSE_ERROR and len(traj.turns) == 1
    # A good reply in between resets the count.
    replies = [BAD, call("add", a=2, b=3), BAD, "5"]
    traj, _, _ = await play(tokenizer, replies, limits=limits(parse_errors=ParseErrorPolicy(max_consecutive=2)))
    assert traj.stop_reason is StopReason.DONE and traj.metrics["parse_errors"] == 2


class BadRewards(ToyEnv):
    @reward(weight=1.0, on_error=-1.0)
    def crashes(self, answer: Any) -> float:
        raise ZeroDivisionError("oops")

    @reward(weight=1.0)
    async def hangs(self) -> float:
        await asyncio.Event().wait()
        return 1.0


async def test_failing_rewards_score_on_error_and_are_counted(tokenizer: Any) -> None:
    traj, env, _ = await play(tokenizer, ["5"], env=BadRewards(), limits=limits(reward_timeout_s=0.05))
    assert traj.stop_reason is StopReason.DONE
    assert traj.rewards == {"correct": 1.0, "crashes": -1.0, "hangs": 0.0}
    assert traj.reward == 2.0 - 1.0
    assert traj.metrics["reward_errors"] == 2
    assert traj.metrics["reward_errors/crashes"] == 1 and traj.metrics["reward_errors/hangs"] == 1
    assert "ZeroDivisionError" in traj.error
    assert env.events == ["setup", "teardown"]


class WhereRewardsRun(ToyEnv):
    @reward(inline=True)
    def on_loop(self) -> float:
        self.events.append(f"inline:{threading.get_ident() == LOOP_THREAD[0]}")
        return 1.0

    @reward(inline=True, on_error=-2.0)
    def inline_crash(self) -> float:
        raise ValueError("bad")

    @metric
    def in_thread(self) -> float:
        self.events.append(f"threaded:{threading.get_ident() == LOOP_THREAD[0]}")
        return 1.0


LOOP_THREAD: list[int] = []


async def test_inline_rewards_run_on_the_loop_and_others_in_a_thread(tokenizer: Any) -> None:
    LOOP_THREAD[:] = [threading.get_ident()]
    traj, env, _ = await play(tokenizer, ["5"], env=WhereRewardsRun())
    assert "inline:True" in env.events and "threaded:False" in env.events
    assert traj.rewards["on_loop"] == 1.0 and traj.rewards["inline_crash"] == -2.0  # a raise still scores on_error
    assert traj.metrics["reward_errors/inline_crash"] == 1


def test_inline_is_refused_for_async_rewards() -> None:
    with pytest.raises(TypeError, match="inline=True is for sync functions"):

        class Bad(Env):
            @reward(inline=True)
            async def r(self) -> float:
                return 0.0


def test_reward_arguments_are_checked_at_class_definition() -> None:
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['reply'\]"):

        class Bad(Env):
            @reward
            def r(self, reply: str) -> float:
                return 0.0


async def test_one_instance_per_episode(tokenizer: Any) -> None:
    env = ToyEnv()
    await run_episode(env, TASK, ScriptedPolicy(["5"], tokenizer), tokenizer)
    with pytest.raises(RuntimeError, match="one instance per episode"):
        await run_episode(env, TASK, ScriptedPolicy(["5"], tokenizer), tokenizer)


async def test_trajectory_round_trips_the_wire(tokenizer: Any) -> None:
    from slime_async.types import Trajectory, from_msgpack, to_msgpack

    traj, _, _ = await play(tokenizer, [call("add", a=2, b=3), "5"])
    back = from_msgpack(to_msgpack(traj), Trajectory)
    assert back.stop_reason is traj.stop_reason and back.rewards == traj.rewards
    assert [list(t.completion_ids) for t in back.turns] == [list(t.completion_ids) for t in traj.turns]


async def test_template_that_rewrites_history_gives_a_marked_branch(tokenizer: Any) -> None:
    import copy

    tok = copy.deepcopy(tokenizer)
    original = "{{ message.content if message.content is string else '' }}"
    tok.chat_template = tok.chat_template.replace(
        original, "{{ message.content if loop.last else message.content.split('</think>')[-1] }}"
    )
    policy = ScriptedPolicy(["<think>hmm</think>" + call("add", a=2, b=3), "5"], tok)
    traj = await run_episode(ToyEnv(), TASK, policy, tok)
    assert traj.stop_reason is StopReason.DONE and traj.reward == 2.0
    first, second = traj.turns
    assert not first.new_branch and second.new_branch and traj.metrics["new_branches"] == 1
    assert list(second.prompt_ids) == policy.seen[1]  # the whole re-rendered context
    assert "hmm" not in tok.decode(second.prompt_ids)
    with pytest.raises(ValueError, match="new branch"):
        traj.flat()


class TimeoutInSetup(ToyEnv):
    async def setup(self, task: Task) -> None:
        raise TimeoutError("database timed out")


class TimeoutInReply(ToyEnv):
    async def on_reply(self, message: Message) -> list[Message] | None:
        raise TimeoutError("user model timed out")


async def test_env_timeouts_are_env_errors_not_limits(tokenizer: Any) -> None:
    traj, _, _ = await play(tokenizer, ["5"], env=TimeoutInSetup(), limits=limits(turn_timeout_s=100))
    assert traj.stop_reason is StopReason.ENV_ERROR and "database timed out" in traj.error
    traj, _, _ = await play(tokenizer, ["5"], env=TimeoutInReply(), limits=limits(turn_timeout_s=100))
    assert traj.stop_reason is StopReason.ENV_ERROR and "user model timed out" in traj.error


async def test_malformed_generation_is_a_server_error(tokenizer: Any) -> None:
    class Broken:
        async def generate(self, input_ids: np.ndarray, sampling: Sampling) -> Generation:
            return Generation(completion_ids=[5, 6], logprobs=[-1.0], versions=[0, 0], finish_reason="stop")

    traj = await run_episode(ToyEnv(), TASK, Broken(), tokenizer)
    assert traj.stop_reason is StopReason.SERVER_ERROR and "2 tokens, 1 logprobs" in traj.error


async def test_template_refusing_the_conversation_is_an_env_error(tokenizer: Any) -> None:
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{%- if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}" + tok.chat_template
    env = ToyEnv()
    traj = await run_episode(env, TASK, ScriptedPolicy([call("add", a=2, b=3), "5"], tok), tok)
    assert traj.stop_reason is StopReason.ENV_ERROR and "rendering failed" in traj.error and "too long" in traj.error
    assert len(traj.turns) == 1 and env.events == ["setup", "teardown"]


async def test_many_episodes_share_one_loop_without_sharing_state(tokenizer: Any) -> None:
    envs = [ToyEnv() for _ in range(24)]
    replies = [[call("add", a=i, b=5 - i), "5"] if i % 2 else [call("add", a=i, b=i), str(2 * i)] for i in range(24)]
    policies = [ScriptedPolicy(r, tokenizer) for r in replies]
    trajs = await asyncio.gather(*(run_episode(e, TASK, p, tokenizer) for e, p in zip(envs, policies, strict=True)))
    assert [t.reward for t in trajs] == [2.0 if i % 2 else 0.0 for i in range(24)]
    assert all(e.events == ["setup", "teardown"] for e in envs)
    assert len({t.id for t in trajs}) == 24
