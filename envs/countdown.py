"""countdown: reach a target number from given numbers with + - * /; reward 1 for a right expression.

The numbers game of the TV show Countdown, as TinyZero and others train reasoning on it: "Using the
numbers 25, 5, 4, make 80" -> `(25-5)*4`. Each given number may be used at most once (with
`use_all`, exactly once: TinyZero's rule); only + - * / and parentheses. The final reply gives the
expression in `<answer>...</answer>`; the reward checks it exactly (rational arithmetic, never
floats), so an answer that reaches the target by reusing a number, by a number it was not given, or
(unless `fractions`) through a fraction on the way scores 0.

The `evaluate` tool is a calculator under the same rules: the model can try a sub-expression and
read its value (or why it is not allowed) before it commits to an answer. It does not check which
numbers are used, on purpose: a search that combines 25-5 = 20 and then tries 20*4 needs to compute
with numbers that are not given.

Tasks are generated backwards from a random expression over the given numbers, so every task has a
solution (`metadata["solution"]`, what `demonstration` shows); `solve` finds one for any task (a
dataset's rows, say) by exhaustive search.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from enum import StrEnum
from fractions import Fraction
from typing import Annotated

import msgspec

from slime_async.env import Env, EnvArgs, HermesParser, Limits, Split, ToolError, metric, reward, tool
from slime_async.types import Task, ToolCall

MAX_EXPRESSION_CHARS = 200
"""A longer expression is refused before it is parsed: a bound on the work one call can ask for."""
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_MISSES = 20_000
"""Draws in a row without a new puzzle after which the generator takes the puzzles to be exhausted."""
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class CountdownError(ValueError):
    """An expression the game does not allow; the message says why (it is what the model reads)."""


class Verdict(StrEnum):
    """What a final reply's answer is."""

    SOLVED = "solved"
    """Keeps the rules and equals the target."""
    MISSED = "missed"
    """Keeps the rules, another value."""
    INVALID = "invalid"
    """Breaks a rule (a number reused or not given, a fraction on the way, not arithmetic)."""
    NONE = "none"
    """No `<answer>` at all."""


class CountdownArgs(EnvArgs):
    num_numbers: Annotated[int, msgspec.Meta(ge=2, le=6)] = 4
    """Numbers given per task (TinyZero: 3 or 4; the show: 6). `solve` searches every way to combine
    them: milliseconds for 4, seconds for 6."""
    min_number: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Smallest given number."""
    max_number: Annotated[int, msgspec.Meta(ge=1)] = 99
    """Largest given number (a number may be given twice, and may then be used twice)."""
    max_target: Annotated[int, msgspec.Meta(ge=1)] = 100
    """Targets are 1..max_target and never one of the given numbers (that would need no arithmetic)."""
    use_all: bool = False
    """Every given number must be used exactly once (TinyZero's rule); False: at most once (the show's)."""
    fractions: bool = False
    """Allow intermediate results that are not whole numbers ((7/2)*4 = 14). False, as on the show:
    every division must come out whole, and the reward and the tool refuse one that does not."""
    format_reward: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    """Partial credit for an answer that is a valid expression over the given numbers but misses the
    target (TinyZero gives 0.1 for the format): it teaches the form of an answer before the search.
    Added to the 1 of a right answer, so a right answer earns 1 + this. 0: none."""
    num_train: Annotated[int, msgspec.Meta(ge=0)] = 20_000
    num_eval: Annotated[int, msgspec.Meta(ge=0)] = 256
    show_tool_schemas: bool = True
    """Put the `evaluate` tool's schema in the prompt (a tiny model that learns the tool from
    demonstrations can do without the tokens)."""
    demo_use_tool: bool = True
    """Demonstrations check the solution with `evaluate` before answering; False: they answer at once."""
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=6, max_tool_calls=8, max_total_tokens=2048))

    def __post_init__(self) -> None:
        # raised while `env.args` is converted: `config show` names the field in one line
        if self.min_number > self.max_number:
            raise ValueError(f"min_number ({self.min_number}) is above max_number ({self.max_number})")


class CountdownEnv(Env):
    Args = CountdownArgs
    args: CountdownArgs

    def __init__(self, args: CountdownArgs | None = None) -> None:
        super().__init__(args)
        self.show_tools = self.args.show_tool_schemas

    @classmethod
    def tasks(cls, args: CountdownArgs, split: Split) -> list[Task]:  # type: ignore[override]
        count = args.num_train if split == "train" else args.num_eval
        out: list[Task] = []
        if count == 0:
            return out
        for task in _generate(args):
            if task.metadata["split"] == split:
                out.append(task)
                if len(out) == count:
                    return out
        raise ValueError(f"env.args: only {len(out)} distinct {split} puzzles exist with these numbers and "
                         f"targets; lower {'num_train' if split == 'train' else 'num_eval'} or widen "
                         f"min_number..max_number or max_target")

    @classmethod
    def demonstration(cls, args: CountdownArgs, task: Task) -> list[str]:  # type: ignore[override]
        # the generator's own expression when it has one (a task of `tasks`); a dataset's task is solved
        solution = task.metadata.get("solution") or solve(
            puzzle_numbers(task), int(task.answer), use_all=args.use_all, fractions=args.fractions)
        if solution is None:
            raise ValueError(f"countdown task {task.id} has no solution: no demonstration")
        replies = []
        if args.demo_use_tool:
            call = ToolCall(name="evaluate", arguments={"expression": solution})
            replies.append(HermesParser().format("", [call]))
        return [*replies, f"<answer>{solution}</answer>"]

    @tool
    async def evaluate(self, expression: Annotated[str, "whole numbers, + - * / and parentheses, e.g. (25-5)*4"]
                       ) -> str:
        """Compute an arithmetic expression exactly, under the game's rules."""
        # Async on purpose: it is bounded (200 characters of + - * / on whole numbers: microseconds),
        # so a thread hop would cost more than the work.
        try:
            return _show(evaluate_exact(expression, fractions=self.args.fractions))
        except CountdownError as exc:
            raise ToolError(str(exc)) from None

    # Inline: parsing one short expression takes microseconds, less than a thread hop.
    @reward(inline=True)
    def correct(self, completion: str, task: Task) -> float:
        """1 when the final reply's <answer> uses only the given numbers, each at most once (exactly
        once with `use_all`), and equals the target."""
        return float(self.verdict(completion, task) is Verdict.SOLVED)

    @reward(inline=True)
    def well_formed(self, completion: str, task: Task) -> float:
        """`format_reward` when the answer is a valid expression over the given numbers, right or not."""
        return self.args.format_reward if self.verdict(completion, task) in _VALID else 0.0

    @metric(inline=True)
    def answered(self, completion: str) -> float:
        """An <answer> tag at all: the form learnt, whatever its content."""
        return float(final_answer(completion) is not None)

    @metric(inline=True)
    def valid_answer(self, completion: str, task: Task) -> float:
        """An answer that keeps the rules, right or not (`well_formed` without its weight)."""
        return float(self.verdict(completion, task) in _VALID)

    def verdict(self, completion: str, task: Task) -> Verdict:
        """What the last `<answer>` of `completion` is, under this env's rules."""
        expression = final_answer(completion)
        if expression is None:
            return Verdict.NONE
        try:
            value = check(expression, puzzle_numbers(task), use_all=self.args.use_all, fractions=self.args.fractions)
        except CountdownError:
            return Verdict.INVALID
        return Verdict.SOLVED if value == int(task.answer) else Verdict.MISSED


_VALID = (Verdict.SOLVED, Verdict.MISSED)


def puzzle_numbers(task: Task) -> list[int]:
    """The given numbers of a task (`metadata["numbers"]`; a dataset's rows must carry them there)."""
    numbers = task.metadata.get("numbers")
    if not isinstance(numbers, list) or not all(type(n) is int for n in numbers):
        raise ValueError(f"countdown task {task.id}: metadata['numbers'] must be a list of whole numbers, "
                         f"got {numbers!r}")
    return numbers


def final_answer(text: str) -> str | None:
    """The expression in the last `<answer>...</answer>` of `text` (a trailing "= 80" dropped)."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    return found[-1].split("=")[0].strip()


def evaluate_exact(expression: str, fractions: bool = False) -> Fraction:
    """The exact value of `expression`: whole numbers, + - * /, parentheses; nothing else (no unary
    minus, no decimals, no names). Without `fractions` every division must come out whole."""
    return _eval(_parse(expression), fractions)


def numbers_in(expression: str) -> list[int]:
    """The numbers `expression` uses, in order of appearance."""
    return [n.value for n in ast.walk(_parse(expression)) if isinstance(n, ast.Constant)]


def check(expression: str, numbers: list[int], use_all: bool = False, fractions: bool = False) -> Fraction:
    """The value of an answer that keeps the rules: only the given `numbers`, each at most once (all of
    them exactly once with `use_all`). Raises CountdownError naming the first rule it breaks."""
    value = evaluate_exact(expression, fractions)
    used, given = Counter(numbers_in(expression)), Counter(numbers)
    extra = used - given
    if extra:
        number = min(extra)
        if number in given:
            raise CountdownError(f"{number} is used {used[number]} times but given {given[number]} time(s)")
        raise CountdownError(f"{number} is not one of the numbers {sorted(numbers)}")
    if use_all and used != given:
        raise CountdownError(f"every number must be used once; unused: {sorted((given - used).elements())}")
    return value


def solve(numbers: list[int], target: int, use_all: bool = False, fractions: bool = False) -> str | None:
    """An expression that makes `target` from `numbers` under the rules, or None when there is none.

    Exhaustive: combine any two values of the pool with each operation and recurse, remembering pools
    already seen (the same values reached in another order need no second look)."""
    seen: set[tuple[Fraction, ...]] = set()

    def search(pool: list[tuple[Fraction, str]]) -> str | None:
        if not use_all:  # the pool's values use disjoint numbers: any one of them may be the answer
            for value, text in pool:
                if value == target:
                    return text
        if len(pool) == 1:
            return pool[0][1] if pool[0][0] == target else None
        key = tuple(sorted(v for v, _ in pool))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(pool)):
            for j in range(len(pool)):
                if i == j:
                    continue
                (a, ta), (b, tb) = pool[i], pool[j]
                rest = [p for k, p in enumerate(pool) if k not in (i, j)]
                for value, text in _combinations(a, ta, b, tb, fractions, ordered=i < j):
                    found = search([*rest, (value, text)])
                    if found is not None:
                        return found
        return None

    found = search([(Fraction(n), str(n)) for n in numbers])
    return _strip_parens(found) if found is not None else None


def _combinations(a: Fraction, ta: str, b: Fraction, tb: str, fractions: bool, ordered: bool
                  ) -> Iterator[tuple[Fraction, str]]:
    """Each value a op b (with its text) the rules allow; + and * once per unordered pair."""
    if ordered:
        yield a + b, f"({ta}+{tb})"
        yield a * b, f"({ta}*{tb})"
    yield a - b, f"({ta}-{tb})"
    if b != 0 and (fractions or (a / b).denominator == 1):
        yield a / b, f"({ta}/{tb})"


def _strip_parens(text: str) -> str:
    """`(25-5)*4` rather than `((25-5)*4)`: the outermost pair adds nothing."""
    if text.startswith("(") and text.endswith(")"):
        depth = 0
        for k, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and k < len(text) - 1:
                return text  # "(a)+(b)": the first parenthesis closes early
        return text[1:-1]
    return text


def _parse(expression: str) -> ast.expr:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CountdownError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():
            # model-written text such as "12x" makes the parser warn on stderr before it fails; the
            # failure is the answer (the model reads it), the warning is noise
            warnings.simplefilter("ignore", SyntaxWarning)
            body = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise CountdownError(f"not an arithmetic expression: {expression!r}") from None
    for node in ast.walk(body):
        # every node checked before any is computed: a refusal never depends on evaluation order
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise CountdownError(f"only whole numbers are allowed, not {ast.unparse(node)}")
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                raise CountdownError(f"only + - * / are allowed, not {ast.unparse(node)!r}")
        elif not isinstance(node, ast.operator):
            raise CountdownError(f"not allowed in the game: {ast.unparse(node)!r} (only numbers, + - * /, parentheses)")
    return body


def _eval(node: ast.expr, fractions: bool) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)  # _parse let nothing else through
    a, b = _eval(node.left, fractions), _eval(node.right, fractions)
    op = type(node.op)
    if op is ast.Add:
        return a + b
    if op is ast.Sub:
        return a - b
    if op is ast.Mult:
        return a * b
    if b == 0:
        raise CountdownError(f"division by zero in {ast.unparse(node)}")
    value = a / b
    if not fractions and value.denominator != 1:
        raise CountdownError(f"{ast.unparse(node)} is {_show(value)}, not a whole number: every step must be one")
    return value


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _generate(args: CountdownArgs) -> Iterator[Task]:
    """Tasks in a fixed order for the args. Each is made backwards: numbers drawn, a random expression
    over all of them computed under the rules, its value the target,
    kept when it is in 1..max_target and not a given number. The split is a hash of the puzzle (its
    sorted numbers and target), so the held-out split never shares a puzzle with the train split."""
    rng = random.Random(f"countdown:{args.num_numbers}:{args.min_number}:{args.max_number}:{args.max_target}:"
                        f"{args.use_all}:{args.seed}")
    seen: set[tuple[tuple[int, ...], int]] = set()
    misses = 0
    while misses < _MAX_MISSES:
        misses += 1
        numbers = [rng.randint(args.min_number, args.max_number) for _ in range(args.num_numbers)]
        # every number in the made expression, with either rule: a solution that needs them all is
        # the puzzle (with at most once, a shorter one may exist by chance; a subset made on purpose
        # gave half the puzzles as one addition of two numbers, since sums of two pass max_target most)
        made = _random_expression(rng, numbers)
        if made is None:
            continue
        value, solution = made
        if not (1 <= value <= args.max_target) or value in numbers:
            continue
        target = int(value)
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        seen.add(key)
        misses = 0
        digest = hashlib.sha256(f"{key}".encode()).hexdigest()
        split: Split = "eval" if int(digest, 16) % 10 == 0 else "train"
        yield Task(
            id=f"countdown-{digest[:16]}",
            prompt=question(numbers, target, args.use_all),
            answer=target,
            metadata={"split": split, "numbers": numbers, "solution": solution},
        )


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[Fraction, str] | None:
    """A random expression over all of `numbers` with whole, positive steps, or None when a draw
    found none (the caller draws again)."""
    pool = [(Fraction(n), str(n)) for n in numbers]
    while len(pool) > 1:
        (a, ta), (b, tb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        if a < b:  # subtract and divide the larger by the smaller: every step stays positive
            (a, ta), (b, tb) = (b, tb), (a, ta)
        options = [(a + b, f"({ta}+{tb})"), (a * b, f"({ta}*{tb})")]
        if a > b:
            options.append((a - b, f"({ta}-{tb})"))
        if (a / b).denominator == 1 and b != 1:
            options.append((a / b, f"({ta}/{tb})"))
        pool.append(rng.choice(options))
    value, text = pool[0]
    return (value, _strip_parens(text)) if value.denominator == 1 else None


def question(numbers: list[int], target: int, use_all: bool = False) -> str:
    rule = "each exactly once" if use_all else "each at most once"
    return (f"Using the numbers {', '.join(map(str, numbers))} ({rule}) and + - * /, make {target}. "
            f"Answer as <answer>expression</answer>.")
