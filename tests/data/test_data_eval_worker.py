"""The evaluation worker process: a round at the baseline, another when the engines' version reaches
the next multiple of `data.eval_every`, results appended as JSON lines."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import post

from slime_async.config import load_config, to_yaml
from slime_async.evaluation.worker import next_due
from slime_async.launch.process import EngineProcess, start_process

pytestmark = pytest.mark.slow


def rounds(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_next_due_skips_to_the_next_multiple() -> None:
    assert [next_due(v, 5) for v in (0, 4, 5, 12)] == [5, 5, 10, 15]


async def test_rounds_follow_the_engine_version(tmp_path: Path, engine: EngineProcess, varied_model_dir: Path) -> None:
    data = tmp_path / "suite.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "label": ".*"}) + "\n" for i in range(2)))
    cfg = load_config(None, [
        f"model.path={varied_model_dir}", "rollout.sampling.max_new_tokens=4", "data.eval_every=2",
        f"data.eval=[{{name: s, source: jsonl, path: '{data}', env: {{name: 'envs.chat:ChatEnv', "
        "args: {verifier: regex}}}]",
    ])
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(cfg))
    out = tmp_path / "eval.jsonl"
    worker = start_process("eval", [sys.executable, "-m", "slime_async.evaluation.worker", str(config), "--engine",
                                    engine.url, "--out", str(out), "--poll-s", "0.2"], r"^READY", timeout=120)
    try:
        wait_until(lambda: len(rounds(out)) >= 1, 120, "the baseline round")
        assert (await post(engine.url, "/update_weight_version", {"new_version": "1"}))[0] == 200
        assert (await post(engine.url, "/update_weight_version", {"new_version": "2"}))[0] == 200
        wait_until(lambda: len(rounds(out)) >= 2, 120, "the round at version 2")
    finally:
        await post(engine.url, "/update_weight_version", {"new_version": "0"})
        worker.proc.send_signal(signal.SIGTERM)
        code = worker.proc.wait(timeout=60)
    first, second = rounds(out)[:2]
    assert first["version"] == 0 and second["version"] == 2  # version 1 is not a multiple of eval_every
    assert first["eval/s/pass@1"] == 1.0 and first["eval/s/num_tasks"] == 2
    assert second["eval/s/version_min"] == 2  # the round's tokens came from the new version
    assert code == 0 and "DONE rounds=" in worker.tail()
