"""The worked example of docs/from_slime.md: a JSONL of math problems that trains with no Python written."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from slime_async.config import load_config
from slime_async.data import build_envs, build_tasks
from slime_async.env import EnvFactory, ScriptedPolicy, run_episode

ROOT = Path(__file__).resolve().parents[2]


async def test_the_slime_math_example_scores_right_and_wrong_answers(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the config's data paths are relative to the repository root
    cfg = load_config(ROOT / "configs/from_slime_math.yaml")
    factory = build_envs(cfg)
    assert isinstance(factory, EnvFactory)
    tasks = build_tasks(cfg, factory)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rewards = []
    for _ in range(8):
        task = next(tasks)
        right = ScriptedPolicy([f"So the answer is \\boxed{{{task.answer}}}."], tokenizer)
        wrong = ScriptedPolicy(["So the answer is \\boxed{-1}."], tokenizer)
        rewards.append((await run_episode(factory.new(), task, right, tokenizer)).reward)
        rewards.append((await run_episode(factory.new(), task, wrong, tokenizer)).reward)
    assert rewards == [1.0, 0.0] * 8
    assert tasks.state().skipped == 0 and tasks.state().served == 8
    assert [s.name for s in cfg.data.eval] == ["math_small"] and cfg.data.eval[0].pass_k == [1, 4]
