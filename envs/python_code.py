"""python_code: write a small Python function; tool `run_python(code)` runs code in the sandbox;
reward 1 when the hidden tests pass.

The hidden tests' inputs go into the sandbox, their expected outputs never do: the harness prints
what the function returned and the comparison happens outside, so a solution cannot pass by
reading the tests. Problems are small families with parameters drawn by seed; the split of a
problem is a hash of its text.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from slime_async.env import Env, EnvArgs, Limits, Split, metric, reward, tool
from slime_async.env.sandbox import SandboxLimits, SandboxResult, run_python
from slime_async.types import Task

_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

# name, signature, description (format with params), reference source, input generator
_Family = tuple[str, str, str, str, Callable[[random.Random], list[Any]]]
_FAMILIES: list[_Family] = [
    (
        "scale", "scale(xs)", "returns a list with every number of xs multiplied by {k}",
        "def scale(xs):\n    return [x * {k} for x in xs]\n",
        lambda r: [[r.randint(-50, 50) for _ in range(r.randint(0, 6))]],
    ),
    (
        "count_multiples", "count_multiples(n)", "returns how many of 1..n are multiples of {k}",
        "def count_multiples(n):\n    return n // {k}\n",
        lambda r: [r.randint(0, 500)],
    ),
    (
        "clip", "clip(xs)", "returns xs with every number limited to the range {lo}..{hi}",
        "def clip(xs):\n    return [min(max(x, {lo}), {hi}) for x in xs]\n",
        lambda r: [[r.randint(-100, 100) for _ in range(r.randint(0, 6))]],
    ),
    (
        "repeat", "repeat(word)", "returns word repeated {k} times, joined by '-'",
        "def repeat(word):\n    return '-'.join([word] * {k})\n",
        lambda r: ["".join(r.choice("abcxyz") for _ in range(r.randint(1, 5)))],
    ),
    (
        "shift", "shift(s)", "returns s with each lowercase letter moved {k} letters on (z wraps to a)",
        "def shift(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
        lambda r: ["".join(r.choice("abcxyz .") for _ in range(r.randint(0, 8)))],
    ),
]  # fmt: skip

_HARNESS = """
import json, sys
from solution import {name}
results = []
for args in json.load(open("inputs.json")):
    try:
        results.append(["ok", {name}(*args)])
    except Exception as exc:
        results.append(["error", type(exc).__name__])
print()
print(json.dumps(results))
"""


class PythonCodeArgs(EnvArgs):
    num_train: Annotated[int, msgspec.Meta(ge=0)] = 5000
    num_eval: Annotated[int, msgspec.Meta(ge=0)] = 100
    tests_per_task: Annotated[int, msgspec.Meta(ge=1)] = 5
    sandbox: SandboxLimits = msgspec.field(default_factory=lambda: SandboxLimits(cpu_s=2, wall_s=5, memory_mb=256))
    limits: Limits = msgspec.field(
        default_factory=lambda: Limits(max_turns=6, max_total_tokens=4096, tool_timeout_s=30)
    )


class PythonCodeEnv(Env):
    Args = PythonCodeArgs
    args: PythonCodeArgs
    system_prompt = "Write the function. Test it with run_python if you like. End with the code in a ```python block."

    def __init__(self, args: PythonCodeArgs | None = None) -> None:
        super().__init__(args)
        self._verdict: tuple[int, int, str] | None = None

    @classmethod
    def tasks(cls, args: PythonCodeArgs, split: Split) -> list[Task]:  # type: ignore[override]
        rng = random.Random(f"python_code:{args.seed}")
        count = args.num_train if split == "train" else args.num_eval
        out: list[Task] = []
        # A problem text belongs to one split for good; the same text may recur with other test inputs.
        while len(out) < count:
            task = _make_task(rng, args.tests_per_task)
            if task.metadata["split"] == split:
                out.append(msgspec.structs.replace(task, id=f"{split}-{args.seed}-{len(out)}-{task.id}"))
        return out

    @tool
    async def run_python(self, code: Annotated[str, "a Python program; its output is returned"]) -> str:
        """Run Python code in a sandbox (no network, limited time and memory)."""
        return _describe(await run_python(code, self.args.sandbox))

    async def _check(self, completion: str) -> tuple[int, int, str]:
        """(tests passed, tests total, why not all) for the final reply's code, computed once."""
        if self._verdict is None:
            assert self.task is not None
            meta = self.task.metadata
            files = {"solution.py": extract_code(completion), "inputs.json": json.dumps(meta["inputs"])}
            result = await run_python(_HARNESS.format(name=meta["function"]), self.args.sandbox, files=files)
            self._verdict = _score(result, meta["expected"])
        return self._verdict

    @reward
    async def tests_pass(self, completion: str) -> float:
        passed, total, _ = await self._check(completion)
        return float(passed == total)

    @metric
    async def tests_passed_fraction(self, completion: str) -> float:
        passed, total, _ = await self._check(completion)
        return passed / total


def extract_code(text: str) -> str:
    """The last ```python block of a reply, or the whole reply when it has none."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def demo_reply(task: Task) -> str:
    """A final reply that solves the task (for tests and demonstrations)."""
    return f"```python\n{task.answer}```"


def _make_task(rng: random.Random, tests: int) -> Task:
    name, signature, description, source, gen = rng.choice(_FAMILIES)
    lo = rng.randint(-20, 0)
    params = {"k": rng.randint(2, 9), "lo": lo, "hi": lo + rng.randint(5, 40)}
    prompt = f"Write a Python function {signature} that {description.format(**params)}."
    solution = source.format(**params)
    namespace: dict[str, Any] = {}
    exec(compile(solution, "<reference>", "exec"), namespace)  # our own reference code, not the model's
    inputs = [gen(rng) for _ in range(tests)]
    expected = [["ok", namespace[name](*args)] for args in inputs]
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    split: Split = "eval" if int(digest, 16) % 10 == 0 else "train"
    return Task(
        id=digest[:12],
        prompt=prompt,
        answer=solution,
        metadata={"split": split, "function": name, "inputs": inputs, "expected": json.loads(json.dumps(expected))},
    )


def _score(result: SandboxResult, expected: list[Any]) -> tuple[int, int, str]:
    total = len(expected)
    if not result.ok:
        why = "timed out" if result.timed_out else f"exit code {result.exit_code}: {result.stderr[-300:]}"
        return 0, total, why
    try:
        got = json.loads(result.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    except (json.JSONDecodeError, IndexError):
        return 0, total, "no results from the harness"
    if not isinstance(got, list) or len(got) != total:
        return 0, total, "malformed results"
    passed = sum(g == e for g, e in zip(got, expected, strict=True))
    return passed, total, "" if passed == total else f"{total - passed} of {total} tests failed"


def _describe(result: SandboxResult) -> str:
    status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
    parts = [status]
    if result.stdout:
        parts.append("stdout:\n" + result.stdout)
    if result.stderr:
        parts.append("stderr:\n" + result.stderr)
    return "\n".join(parts)
