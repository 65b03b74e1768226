"""Fixtures of the agent tests: a tiny model that has learnt to call the calculator, served by a
real embedded engine process."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.calculator import CalculatorEnv
from slime_async.env import EnvFactory, ScriptedPolicy, run_episode
from slime_async.launch.process import EngineProcess, start_engine
from slime_async.types import Task

NUM_TASKS = 8


@pytest.fixture(scope="session")
def calc_tasks() -> list[Task]:
    """The tasks the tool-calling model has learnt by heart."""
    return list(CalculatorEnv.tasks(CalculatorEnv.Args(), "train"))[:NUM_TASKS]


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, calc_tasks: list[Task], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained (seconds, on CPU) on correct calculator episodes of `calc_tasks` until
    it reproduces them greedily: a tool call, then the answer. Real tool calls from a real engine."""
    out = tmp_path_factory.mktemp("tool_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    factory = EnvFactory.from_config("envs.calculator:CalculatorEnv")

    async def demos() -> list:
        return [await run_episode(factory.new(), t, ScriptedPolicy(factory.cls.demonstration(factory.args, t),
                                                                    tokenizer), tokenizer) for t in calc_tasks]

    rows = [t.flat() for t in asyncio.run(demos())]
    length = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for i, (tokens, _, m) in enumerate(rows):
        ids[i, : len(tokens)] = torch.from_numpy(tokens.astype("int64"))
        mask[i, : len(tokens)] = torch.from_numpy(m.astype("float32"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # clipped at 1: at 3e-3 unclipped the loss spiked back up several times (282 steps to 1e-3; 121 here)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(400):
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if loss.item() < 1e-3:  # greedy decoding reproduces every episode by then
            print("tool model: loss", loss.item(), "after", step + 1, "steps")
            break
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_engine(tool_model_dir: Path) -> Iterator[EngineProcess]:
    proc = start_engine(tool_model_dir, "--max-batch-size", "16", "--context-length", "1024")
    try:
        yield proc
    finally:
        proc.stop()
