"""calculator: arithmetic problems with a `calculate` tool; reward 1 for the exact answer.

The embedded default's task, sized for a 3.4M-parameter model: prompts are a handful of tokens
("What is 23*45+67?"), the tool schema is not put in the prompt (the model learns the tool from
demonstrations; `show_tool_schemas: true` puts it back), and the answer is "The answer is N.".

Variants:
- `one_step`: `A*B+C` (or `A*B-C`); one call of `calculate` does it.
- `two_step`: `(A*B+C)*D-E`, and `calculate` takes at most two operations per call, so it needs
  two dependent calls: the second one uses the first one's result.

`demo_replies(task)` gives the assistant replies of a correct episode; `demo_transcripts` runs
them through `run_episode` with a `ScriptedPolicy`: token-exact trajectories with loss masks,
for a supervised warm-start.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

import msgspec

from envs.arith import ExpressionError, count_operations, evaluate
from slime_async.env import (
    Env,
    EnvArgs,
    HermesParser,
    Limits,
    ScriptedPolicy,
    Split,
    ToolError,
    metric,
    reward,
    run_episode,
    tool,
)
from slime_async.types import Task, ToolCall, Trajectory

Variant = Literal["one_step", "two_step"]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD_PROBLEMS = (
    "{a} boxes of {b} pens and {c} more pens. How many pens?",
    "{a} rows of {b} seats and {c} more seats. How many seats?",
)


class CalculatorArgs(EnvArgs):
    variant: Variant = "one_step"
    style: Literal["expression", "word"] = "expression"
    """`expression`: "What is 23*45+67?"; `word`: a one-line word problem (one_step only)."""
    digits: Annotated[int, msgspec.Meta(ge=1, le=6)] = 2
    """Digits of each operand."""
    num_train: Annotated[int, msgspec.Meta(ge=0)] = 20_000
    num_eval: Annotated[int, msgspec.Meta(ge=0)] = 256
    max_ops_per_call: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Operations one `calculate` call may hold; None: 2 for two_step, unbounded for one_step."""
    show_tool_schemas: bool = False
    tool_latency_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Median of an injected, lognormal delay of each `calculate` call (0: none): a stand-in for
    real tools, whose latency has a long tail."""
    tool_latency_p99: Annotated[float, msgspec.Meta(ge=1.0)] = 10.0
    """The injected delay's p99 as a multiple of its median (lognormal sigma = ln(this) / 2.326)."""
    demo_tool_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """Fraction of the demonstrations (`Env.demonstration`, the warm-start's) that call the tool; the
    others answer at once, which a tiny model cannot do right. Below 1 the warm-started model often
    skips the tool, and RL has to learn to use it. Which tasks: a hash of the task id."""
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=4, max_total_tokens=512, max_tool_calls=4))


class CalculatorEnv(Env):
    Args = CalculatorArgs
    args: CalculatorArgs

    def __init__(self, args: CalculatorArgs | None = None) -> None:
        super().__init__(args)
        self.show_tools = self.args.show_tool_schemas
        self.max_ops = self.args.max_ops_per_call or (2 if self.args.variant == "two_step" else None)

    @classmethod
    def tasks(cls, args: CalculatorArgs, split: Split) -> list[Task]:  # type: ignore[override]
        count = args.num_train if split == "train" else args.num_eval
        out = []
        for task in _generate(args, seed=args.seed):
            if task.metadata["split"] == split:
                out.append(task)
                if len(out) == count:
                    break
        return out

    @classmethod
    def demonstration(cls, args: CalculatorArgs, task: Task) -> list[str]:  # type: ignore[override]
        return demo_replies(task, use_tool=_unit_hash(task.id) < args.demo_tool_fraction)

    @tool
    async def calculate(self, expression: Annotated[str, "arithmetic, e.g. 12*34+5"]) -> str:
        """Evaluate an arithmetic expression."""
        if self.args.tool_latency_s > 0:
            sigma = math.log(self.args.tool_latency_p99) / 2.326
            await asyncio.sleep(random.lognormvariate(math.log(self.args.tool_latency_s), sigma))
        # Async on purpose: it is bounded (200 characters, exponent <= 64), so a thread hop would
        # cost more than the work.
        try:
            if self.max_ops is not None and count_operations(expression) > self.max_ops:
                raise ToolError(f"at most {self.max_ops} operations per call")
            return str(evaluate(expression))
        except ExpressionError as exc:
            raise ToolError(str(exc)) from None

    # Inline: a regex over the final reply takes microseconds, less than a thread hop.
    @reward(inline=True)
    def correct(self, completion: str, answer: Any) -> float:
        """1 when the last number of the final reply is the answer."""
        value = final_number(completion)
        return float(value is not None and value == answer)

    @metric(inline=True)
    def answered(self, completion: str) -> float:
        return float(final_number(completion) is not None)


def final_number(text: str) -> int | float | None:
    """The last number in `text` ("The answer is 1102." → 1102)."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = float(found[-1])
    return int(value) if value.is_integer() else value


def demo_replies(task: Task, use_tool: bool = True) -> list[str]:
    """Assistant replies of a correct episode: the tool calls (each using the previous result),
    then "The answer is N.". `use_tool=False` answers at once (a demonstration without the tool)."""
    parser = HermesParser()
    replies = []
    if use_tool:
        for step in task.metadata["steps"]:
            replies.append(parser.format("", [ToolCall(name="calculate", arguments={"expression": step})]))
    return [*replies, f"The answer is {task.answer}."]


async def demo_transcripts(
    tasks: Iterable[Task], tokenizer: Any, args: CalculatorArgs | None = None, tool_fraction: float = 1.0, seed: int = 0
) -> list[Trajectory]:
    """Token-exact trajectories of correct episodes, with loss masks (1 on the model's replies),
    for a supervised warm-start. A `tool_fraction` of them use the tool; the rest answer at once
    (which of them is drawn by `seed`)."""
    rng = random.Random(seed)
    out = []
    for task in tasks:
        replies = demo_replies(task, use_tool=rng.random() < tool_fraction)
        env = CalculatorEnv(args)
        out.append(await run_episode(env, task, ScriptedPolicy(replies, tokenizer), tokenizer))
    return out


def _unit_hash(text: str) -> float:
    """A number in [0, 1) fixed by `text` (the same in every process, unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def _generate(args: CalculatorArgs, seed: int) -> Iterator[Task]:
    """Problems in a fixed order for a seed. The split of a problem is a hash of its text, so the
    held-out split never shares a problem with the train split, whatever the counts."""
    rng = random.Random(f"calculator:{args.variant}:{args.style}:{args.digits}:{seed}")
    lo, hi = 10 ** (args.digits - 1), 10**args.digits - 1
    seen: set[str] = set()
    while True:
        a, b, c = rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi)
        sign = rng.choice("+-")
        first = f"{a}*{b}{sign}{c}"
        x = evaluate(first)
        if args.variant == "two_step":
            d, e = rng.randint(2, 9), rng.randint(lo, hi)
            expression = f"({first})*{d}-{e}"
            steps = [first, f"{x}*{d}-{e}"]
            prompt = f"What is {expression}?"
        else:
            expression, steps = first, [first]
            if args.style == "word" and sign == "+":
                prompt = rng.choice(_WORD_PROBLEMS).format(a=a, b=b, c=c)
            else:
                prompt = f"What is {expression}?"
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = evaluate(expression)
        split: Split = "eval" if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10 == 0 else "train"
        yield Task(
            id=hashlib.sha256(f"{args.variant}:{prompt}".encode()).hexdigest()[:16],
            prompt=prompt,
            answer=answer,
            metadata={"split": split, "expression": expression, "steps": steps, "variant": args.variant},
        )
