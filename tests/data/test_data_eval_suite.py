"""Two evaluation suites from the config, run beside a training rollout on the same real engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime_async.config import load_config
from slime_async.env import EnvFactory, Limits, Sampling
from slime_async.evaluation import EvalSuite, run_suites, suites_from_config
from slime_async.launch.process import EngineProcess
from slime_async.rollout import ListSink, Scheduler, SGLangClient


def write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


async def test_two_suites_beside_a_training_rollout(tmp_path: Path, engine: EngineProcess, tokenizer) -> None:
    # Regex labels make the expected metrics exact whatever the tiny model says: ".*" matches any
    # reply, "ZZZ_NEVER" none.
    always = write(tmp_path / "always.jsonl", [{"prompt": f"Say {i}.", "label": ".*"} for i in range(3)])
    half = write(tmp_path / "half.jsonl", [{"prompt": f"Q{i}?", "label": ".*" if i % 2 else "ZZZ_NEVER"}
                                           for i in range(4)] + ["{broken"])
    chat = "{name: 'envs.chat:ChatEnv', args: {verifier: regex}}"
    cfg = load_config(None, [
        "rollout.sampling.max_new_tokens=6",
        f"data.eval=[{{name: always, source: jsonl, path: '{always}', env: {chat}}},"
        f" {{name: half, source: jsonl, path: '{half}', env: {chat}, n_samples: 2, pass_k: [1, 2],"
        "   sampling: {temperature: 1.0, max_new_tokens: 6}}]",
    ])
    suites = suites_from_config(cfg)
    assert [s.name for s in suites] == ["always", "half"] and suites[0].sampling.temperature == 0.0
    assert suites[1].skipped_rows == 1 and len(suites[1].tasks) == 4

    train_factory = EnvFactory.from_config("envs.calculator:CalculatorEnv", {})
    sink = ListSink()
    async with SGLangClient([engine.url]) as train_client, SGLangClient([engine.url]) as eval_client:
        training = Scheduler(train_factory, train_factory.tasks("train"), train_client, tokenizer, sink,
                             group_size=2, batch_size=4, sampling=Sampling(max_new_tokens=6),
                             limits=Limits(max_turns=2), filter_equal_rewards=False)
        train_run = asyncio.ensure_future(training.run(num_groups=4))
        results = await run_suites(suites, eval_client, tokenizer)
        stats = await train_run
    assert stats.balanced() and stats.sent == 8
    a, h = results["always"].metrics, results["half"].metrics
    assert a["pass@1"] == 1.0 and a["mean_reward"] == 1.0 and a["num_tasks"] == 3 and a["num_samples"] == 3
    assert h["pass@1"] == 0.5 and h["pass@2"] == 0.5 and h["num_samples"] == 8 and h["skipped_rows"] == 1
    assert a["dropped_tasks"] == 0 and h["version_min"] == 0
    assert results["half"].flat()["eval/half/pass@2"] == 0.5
    assert all(len(g) == 2 for g in results["half"].groups)


def test_suite_errors_name_the_suite() -> None:
    factory = EnvFactory.from_config("envs.chat:ChatEnv", {})
    with pytest.raises(ValueError, match="'empty' has no tasks"):
        EvalSuite(name="empty", envs=factory, tasks=[])
