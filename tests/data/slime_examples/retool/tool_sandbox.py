"""Stub of slime's examples/retool/tool_sandbox.py: the same names (`SEMAPHORE`, `TOOL_CONFIGS`,
`tool_registry` with `get_tool_specs()` and `execute_tool(name, arguments)`), but code is not run:
`print(EXPR)` of an arithmetic expression is answered with its value, anything else with a fixed
line. Each call is recorded."""

from __future__ import annotations

import ast
import asyncio
import operator
import re
from typing import Any

SEMAPHORE = asyncio.Semaphore(8)
TOOL_CONFIGS = {"max_turns": 3, "max_tool_calls": 2}
CALLS: list[dict[str, Any]] = []

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _arith(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    raise ValueError("not arithmetic")


class ToolRegistry:
    def get_tool_specs(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": "code_interpreter",
                    "description": "Run Python code.",
                    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                },
            }
        ]

    async def execute_tool(self, name: str, arguments: dict[str, Any]) -> str:
        CALLS.append({"name": name, **arguments})
        found = re.fullmatch(r"\s*print\((.*)\)\s*", arguments.get("code", ""), re.DOTALL)
        try:
            return str(_arith(ast.parse(found.group(1), mode="eval").body)) if found else "(stub) ran"
        except (ValueError, SyntaxError):
            return "(stub) ran"


tool_registry = ToolRegistry()
