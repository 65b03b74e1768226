"""countdown: solved by its own demonstrations; answers that break a rule, miss or never come score 0."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import msgspec
import pytest

from envs.countdown import (
    CountdownArgs,
    CountdownEnv,
    CountdownError,
    check,
    evaluate_exact,
    final_answer,
    question,
    solve,
)
from slime_async.env import EnvFactory, HermesParser, ScriptedPolicy, run_episode
from slime_async.types import StopReason, Task, ToolCall


def puzzle(numbers: list[int], target: int, use_all: bool = False) -> Task:
    return Task(id=f"t{numbers}{target}", prompt=question(numbers, target, use_all), answer=target,
                metadata={"numbers": numbers})


async def play(tokenizer: Any, task: Task, replies: list[str], **kw: Any) -> Any:
    env = CountdownEnv(CountdownArgs(**kw))
    return await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer)


def call(expression: str) -> str:
    return HermesParser().format("", [ToolCall(name="evaluate", arguments={"expression": expression})])


@pytest.mark.parametrize("kw", [{}, {"use_all": True}, {"num_numbers": 3, "show_tool_schemas": False},
                                {"num_numbers": 6, "demo_use_tool": False}])
async def test_demonstrations_solve_every_task(tokenizer: Any, kw: dict[str, Any]) -> None:
    args = CountdownArgs(num_train=4, num_eval=4, **kw)
    for split in ("train", "eval"):
        for task in CountdownEnv.tasks(args, split):
            traj = await play(tokenizer, task, CountdownEnv.demonstration(args, task), **kw)
            assert traj.stop_reason is StopReason.DONE, traj.error
            assert traj.rewards == {"correct": 1.0, "well_formed": 0.1} and traj.reward == pytest.approx(1.1)
            assert traj.metrics["valid_answer"] == 1.0
            assert traj.metrics["tool_calls"] == (1 if args.demo_use_tool else 0)
            assert traj.metrics["tool_errors"] == 0


async def test_answers_that_break_a_rule_score_nothing(tokenizer: Any) -> None:
    task = puzzle([25, 5, 4, 3], 80)
    # right value, but: a number used twice, numbers not given, a decimal, unary minus, an operator the
    # game lacks; no expression at all; a division by zero
    for bad in ("25*4-5*4", "20*4", "(25*5-45)", "80.0", "-(5-25)*4", "5**2+55", "eighty", "(25-5)*4+5/(3-3)"):
        traj = await play(tokenizer, task, [f"<answer>{bad}</answer>"])
        assert traj.stop_reason is StopReason.DONE
        assert traj.rewards == {"correct": 0.0, "well_formed": 0.0}, bad
        assert traj.metrics["answered"] == 1.0 and traj.metrics["valid_answer"] == 0.0
    missed = await play(tokenizer, task, ["<answer>25*4-5</answer>"])  # valid, 95: the format's credit only
    assert missed.rewards == {"correct": 0.0, "well_formed": 0.1} and missed.metrics["valid_answer"] == 1.0
    for none in ("(25-5)*4", "The answer is 80."):  # no <answer> tag
        traj = await play(tokenizer, task, [none])
        assert traj.reward == 0.0 and traj.metrics["answered"] == 0.0
    right = await play(tokenizer, task, ["I think <answer>(25 - 5) * 4 = 80</answer>"], format_reward=0.0)
    assert right.rewards == {"correct": 1.0, "well_formed": 0.0}


async def test_use_all_and_fractions_change_the_rules(tokenizer: Any) -> None:
    task = puzzle([25, 5, 4, 3], 80, use_all=True)
    assert (await play(tokenizer, task, ["<answer>(25-5)*4</answer>"])).reward == pytest.approx(1.1)
    traj = await play(tokenizer, task, ["<answer>(25-5)*4</answer>"], use_all=True)  # 3 unused
    assert traj.reward == 0.0
    every = puzzle([25, 5, 4, 3], 85, use_all=True)
    assert (await play(tokenizer, every, ["<answer>25*4-5*3</answer>"], use_all=True)).reward == pytest.approx(1.1)
    halves = puzzle([7, 2, 4], 14)
    assert (await play(tokenizer, halves, ["<answer>7/2*4</answer>"])).reward == 0.0
    assert (await play(tokenizer, halves, ["<answer>7/2*4</answer>"], fractions=True)).reward == pytest.approx(1.1)


async def test_the_tool_computes_and_refuses_like_the_reward(tokenizer: Any) -> None:
    task = puzzle([25, 5, 4, 3], 80)
    replies = [call("25-5"), call("20*4"), call("7/2"), call("5/(3-3)"), call("2**8"),
               "<answer>(25-5)*4</answer>"]  # six replies: the default max_turns
    traj = await play(tokenizer, task, replies)
    assert traj.reward == pytest.approx(1.1)
    assert traj.metrics["tool_calls"] == 5 and traj.metrics["tool_errors/evaluate"] == 3
    shown = [tokenizer.decode(t.prompt_ids).split("<tool_response>")[-1].split("</tool_response>")[0]
             for t in traj.turns[1:]]
    assert shown[:2] == ["20", "80"]  # 20 is no given number: the tool is a calculator, the reward judges
    assert shown[2] == "error: 7 / 2 is 7/2, not a whole number: every step must be one"
    assert shown[3] == "error: division by zero in 5 / (3 - 3)"
    assert shown[4] == "error: only + - * / are allowed, not '2 ** 8'"
    fractions = await play(tokenizer, task, [call("7/2*3"), "<answer>0</answer>"], fractions=True)
    assert fractions.metrics["tool_errors"] == 0


@pytest.mark.parametrize(
    ("expression", "why"),
    [("__import__('os').system('true')", "not allowed"), ("(1).__class__", "not allowed"), ("[1]*9", "not allowed"),
     ("True+1", "whole numbers"), ("lambda: 1", "not allowed"), ("1;2", "not an arithmetic expression"),
     ("9" * 201, "longer than"), ("3 % 2", "only"), ("6 // 2", "only"), ("1.5*2", "whole numbers")],
)  # fmt: skip
def test_evaluation_refuses_anything_but_whole_number_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(CountdownError, match=why):
        evaluate_exact(expression, fractions=True)


def test_evaluation_is_exact() -> None:
    assert evaluate_exact("(25-5)*4") == 80
    assert evaluate_exact("1/3+1/3+1/3", fractions=True) == 1  # floats would say 0.9999999999999999
    assert evaluate_exact("7/2", fractions=True) == Fraction(7, 2)
    assert evaluate_exact("(3-10)*2") == -14  # a negative step is allowed (as TinyZero's checker)


def test_check_names_the_rule_broken() -> None:
    assert check("(25-5)*4", [25, 5, 4, 3]) == 80
    assert check("5+5", [5, 5, 1]) == 10  # a number given twice may be used twice
    with pytest.raises(CountdownError, match="5 is used 2 times but given 1"):
        check("5*5", [5, 25])
    with pytest.raises(CountdownError, match=r"20 is not one of the numbers \[4, 5, 25\]"):
        check("20*4", [25, 5, 4])
    with pytest.raises(CountdownError, match=r"unused: \[3\]"):
        check("(25-5)*4", [25, 5, 4, 3], use_all=True)


def test_final_answer() -> None:
    assert final_answer("think <answer>1+2</answer> then <answer> (3*4) = 12 </answer>") == "(3*4)"
    assert final_answer("<answer>\n1+2\n</answer>") == "1+2"
    assert final_answer("no tag") is None


def test_solver_finds_a_solution_when_there_is_one() -> None:
    for numbers, target, use_all in (([25, 5, 4, 3], 80, False), ([1, 3, 7, 10, 25, 50], 765, False),
                                     ([2, 3, 5], 1, True), ([4, 4, 4, 4], 17, True)):
        found = solve(numbers, target, use_all=use_all)
        assert found is not None and check(found, numbers, use_all=use_all) == target, found
    assert solve([7, 2], 3) is None and solve([1, 1, 1], 100) is None
    # 5 * (5 - 1/5) is the one way to 24: through a fraction
    assert solve([1, 5, 5, 5], 24, use_all=True) is None
    assert check(solve([1, 5, 5, 5], 24, use_all=True, fractions=True) or "0", [1, 5, 5, 5], fractions=True) == 24
    assert solve([9, 8], 72, use_all=True) == "9*8"


def test_tasks_are_deterministic_solvable_and_split() -> None:
    args = CountdownArgs(num_train=2000, num_eval=200)
    train, held_out = CountdownEnv.tasks(args, "train"), CountdownEnv.tasks(args, "eval")
    assert train == CountdownEnv.tasks(args, "train")
    assert train != CountdownEnv.tasks(CountdownArgs(seed=1, num_train=2000), "train")
    puzzles = {(tuple(sorted(t.metadata["numbers"])), t.answer) for t in train}
    assert len(puzzles) == 2000 and not puzzles & {(tuple(sorted(t.metadata["numbers"])), t.answer) for t in held_out}
    for task in train[:300]:
        numbers, target = task.metadata["numbers"], task.answer
        assert len(numbers) == 4 and all(1 <= n <= 99 for n in numbers) and 1 <= target <= 100
        assert target not in numbers
        # the generator's solution uses every number, whatever the rule
        assert check(task.metadata["solution"], numbers, use_all=True) == target
        assert solve(numbers, target) is not None


def test_demonstration_solves_a_dataset_task_without_a_solution() -> None:
    args = CountdownArgs(demo_use_tool=False)
    [reply] = CountdownEnv.demonstration(args, puzzle([25, 5, 4, 3], 80))
    expression = final_answer(reply)
    assert expression is not None and check(expression, [25, 5, 4, 3]) == 80
    with pytest.raises(ValueError, match="no solution"):
        CountdownEnv.demonstration(args, puzzle([1, 1], 100))


def test_bad_args_are_refused_naming_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"min_number \(50\) is above max_number \(9\)"):
        msgspec.convert({"min_number": 50, "max_number": 9}, CountdownArgs)
    with pytest.raises(msgspec.ValidationError, match="num_numbers"):
        msgspec.convert({"num_numbers": 7}, CountdownArgs)
    with pytest.raises(ValueError, match=r"only 11 distinct train puzzles.*lower num_train"):
        CountdownEnv.tasks(CountdownArgs(num_numbers=2, max_number=3, num_train=50), "train")


def test_factory_builds_it_from_a_config() -> None:
    factory = EnvFactory.from_config("envs.countdown:CountdownEnv", {"num_numbers": 3, "num_eval": 3})
    assert isinstance(factory.new(), CountdownEnv) and len(list(factory.tasks("eval"))) == 3
    assert set(factory.cls.tools) == {"evaluate"} and set(factory.cls.rewards) == {"correct", "well_formed"}


async def test_a_dataset_row_without_its_numbers_is_a_counted_reward_error(tokenizer: Any) -> None:
    row = Task(id="row-7", prompt="make 80", answer="80", metadata={})
    traj = await play(tokenizer, row, ["<answer>(25-5)*4</answer>"])
    assert traj.reward == 0.0 and traj.metrics["reward_errors/correct"] == 1
    assert "row-7: metadata['numbers'] must be a list of whole numbers, got None" in traj.errors["reward correct"]
    # with its numbers, a label read from a file as text still compares as a number
    row = Task(id="row-8", prompt="make 80", answer="80", metadata={"numbers": [25, 5, 4]})
    assert (await play(tokenizer, row, ["<answer>(25-5)*4</answer>"])).rewards["correct"] == 1.0
