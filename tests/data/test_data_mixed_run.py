"""One run, two environments: rows of a JSONL file choose theirs, the scheduler runs each in its own
against a real engine process over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

from slime_async.config import load_config
from slime_async.data import EnvRouter, build_envs, build_tasks
from slime_async.env import Limits, Sampling
from slime_async.launch.process import EngineProcess
from slime_async.rollout import ListSink, Scheduler, SGLangClient
from slime_async.types import Task


async def test_rows_choose_their_env_in_one_run(tmp_path: Path, engine: EngineProcess, tokenizer) -> None:
    rows = [{"prompt": f"What is {i}*3+1?", "label": 3 * i + 1, "env": "calc"} if i % 2 else
            {"prompt": f"Say the word w{i}.", "label": f"w{i}", "env": "chat"} for i in range(6)]
    rows.insert(3, {"prompt": "x", "label": 0, "env": "unknown"})
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [
        "data.source=jsonl", f"data.path={path}", "data.env_key=env", "data.epochs=1",
        "data.envs={calc: {name: 'envs.calculator:CalculatorEnv'}, chat: {name: 'envs.chat:ChatEnv'}}",
    ])
    router = build_envs(cfg)
    stream = build_tasks(cfg, router)
    sink = ListSink()
    async with SGLangClient([engine.url]) as client:
        scheduler = Scheduler(router, stream, client, tokenizer, sink, group_size=2, batch_size=4,
                              max_concurrency=8, sampling=Sampling(max_new_tokens=8), limits=Limits(max_turns=2),
                              filter_equal_rewards=False)
        stats = await scheduler.run()
    names = {"calc": "envs.calculator:CalculatorEnv", "chat": "envs.chat:ChatEnv"}
    assert len(sink.groups) == 6 and stats.balanced() and stats.sent == 12
    env_of_task = {t.task_id: t.env for g in sink.groups for t in g}
    # Task ids are `FILE_STEM:ROW_INDEX`: each trajectory ran in the env its row named.
    assert env_of_task == {f"mixed:{i}": names[r["env"]] for i, r in enumerate(rows) if r["env"] != "unknown"}
    for t in (t for g in sink.groups for t in g):
        assert t.turns and len(t.turns[0].completion_ids) == len(t.turns[0].versions)
    assert stream.state().skipped == 1 and f"{path}:4: unknown environment 'unknown'" in stream.errors[0]

async def test_a_task_naming_an_unknown_env_costs_that_task_only(engine: EngineProcess, tokenizer) -> None:
    router = EnvRouter({"chat": build_envs(load_config(None, ["env.name=envs.chat:ChatEnv"]))})  # type: ignore[dict-item]
    tasks = [Task(id="a", prompt="hi", answer="x", metadata={"env": "chat"}),
             Task(id="b", prompt="hi", answer="x", metadata={"env": "other"}),
             Task(id="c", prompt="hi", answer="x", metadata={"env": "chat"})]
    sink = ListSink()
    async with SGLangClient([engine.url]) as client:
        scheduler = Scheduler(router, tasks, client, tokenizer, sink, group_size=1, sampling=Sampling(max_new_tokens=4),
                              filter_equal_rewards=False)
        stats = await scheduler.run()
    assert [g[0].task_id for g in sink.groups] == ["a", "c"] and stats.groups_dropped == {"bad_task": 1}
    assert stats.balanced()
