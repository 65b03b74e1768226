"""Drives verifiers 0.3.1's ToolEnv against the minimal server; runs in its own venv (see orchestration.py).

`python verifiers_driver.py BASE_URL EPISODES CONCURRENCY` prints one JSON line:
{"episodes", "turns", "wall_s", "cpu_s"}. Same task shape as slime_async's side: a question, one
`calculate` call, then the answer; the minimal server returns the same replies to both.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys
import time

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: arithmetic, e.g. 12*34+5
    """

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError("unsupported expression")

    return str(ev(ast.parse(expression, mode="eval").body))


def main() -> None:
    import verifiers as vf
    from datasets import Dataset

    base_url, episodes, concurrency = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dataset = Dataset.from_list([{"question": f"What is 12*34+{i % 10}?", "answer": "413"} for i in range(episodes)])

    def correct(completion, answer, **kwargs) -> float:
        return float(answer in str(completion))

    env = vf.ToolEnv(tools=[calculate], max_turns=4, eval_dataset=dataset, rubric=vf.Rubric(funcs=[correct]))
    os.environ["MINIMAL_SERVER_KEY"] = "unused"
    client = vf.ClientConfig(client_type="openai_chat_completions", api_base_url=base_url + "/v1",
                             api_key_var="MINIMAL_SERVER_KEY")
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    out = asyncio.run(env.evaluate(client, model="tiny", num_examples=episodes, rollouts_per_example=1,
                                   max_concurrent=concurrency, on_progress=lambda *a, **k: None))
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    turns = _count_turns(out)
    print(json.dumps({"episodes": episodes, "turns": turns, "wall_s": wall, "cpu_s": cpu}), flush=True)


def _count_turns(out) -> int:
    """Assistant messages over all rollouts' completions: the model calls verifiers made."""
    turns = 0
    for rollout in out["outputs"]:
        completion = rollout["completion"] if isinstance(rollout, dict) else rollout.completion
        turns += sum(1 for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant")
    return turns


if __name__ == "__main__":
    main()
