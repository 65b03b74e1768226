"""The rollout worker process reads the config's `data:` section and resumes its task stream from
a saved state: a second run continues where the first stopped, nothing replayed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from slime_async.buffer import BufferClient, ServerSettings
from slime_async.config import load_config, to_yaml
from slime_async.data import build_envs, build_tasks, load_state
from slime_async.launch.process import EngineProcess, start_process

pytestmark = pytest.mark.slow


def test_a_restarted_worker_continues_the_data(tmp_path: Path, engine: EngineProcess, varied_model_dir: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "label": ".*", "uid": f"q{i}"}) + "\n"
                            for i in range(6)))
    cfg = load_config(None, [
        f"model.path={varied_model_dir}", "env.name=envs.chat:ChatEnv", "env.args={verifier: regex}",
        "data.source=jsonl", f"data.path={data}", "data.id_key=uid", "data.seed=7", "rollout.group_size=2",
        "rollout.batch_size=4", "rollout.max_staleness=100", "rollout.sampling.max_new_tokens=4",
        "rollout.filter_equal_rewards=false", "buffer.wal_dir=null", f"run.dir={tmp_path}",
    ])
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(cfg))
    buffer = start_process("buffer", [sys.executable, "-m", "slime_async.buffer",
                                      msgspec.json.encode(ServerSettings.from_config(cfg)).decode()], r"^READY (\S+)")
    state = tmp_path / "data-state.json"
    try:
        for run in (1, 2):
            done = subprocess.run(
                [sys.executable, "-m", "slime_async.rollout.worker", str(config), "--buffer", buffer.ready,
                 "--engine", engine.url, "--groups", "2", "--data-state", str(state)],
                capture_output=True, text=True, timeout=180,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert load_state(state).served == 2 * run
        with BufferClient(buffer.ready) as trainer:
            batch = trainer.get_batch(8, timeout=60)
    finally:
        buffer.stop()
    got = sorted(g.task_id for g in batch.groups)
    stream = build_tasks(cfg, build_envs(cfg))
    assert got == sorted(next(stream).id for _ in range(4))  # the first four of the order, each once
