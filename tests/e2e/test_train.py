"""`slime-async train` end to end: buffer, engine, trainer and rollout worker as real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from two_api_agent import uses_messages_api

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions `text` (our children name the run's config file)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and entry.name != str(os.getpid()):
                pids.append(int(entry.name))
    return pids


def train_command(run_dir: Path, *overrides: str, config: str = "configs/local.yaml") -> list[str]:
    return [sys.executable, "-m", "slime_async.cli", "train", str(REPO / config), "--overwrite",
            f"run.dir={run_dir}", "rollout.batch_size=8", "rollout.group_size=4", "rollout.filter_equal_rewards=false",
            "rollout.sampling.max_new_tokens=16", "engine.port=0",
            # a few steps of warm-start (cached for the session) and a small success check: the
            # whole path of the embedded default, in seconds
            "warmstart.stages=[]", "warmstart.examples=64", "warmstart.check_tasks=8", "warmstart.min_success=0",
            "data.eval_every=0",
            *overrides]


def start_training(command: list[str]) -> subprocess.Popen:
    """`slime-async train` as its own session (a test can kill the launcher and all it started)."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, metrics_path: Path, steps: int, timeout: float = 300) -> None:
    """Wait (bounded) until `metrics.jsonl` has `steps` lines: the trainer is inside its loop."""
    deadline = time.monotonic() + timeout
    while not (metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, f"training never reached step {steps}"
        time.sleep(0.2)  # polling a file another process writes: there is nothing to wait on


def test_a_black_box_agent_in_two_apis_trains_through_every_part(tmp_path: Path) -> None:
    """configs/calculator_agent.yaml: the agent is an `openai` SDK program and its `anthropic` SDK twin
    (through /v1/messages), half the tasks each (`two_api_agent`); its warm-start's demonstrations, the
    success checks, rollout and evaluation all go through the endpoint."""
    done = subprocess.run(train_command(tmp_path, "train.steps=3", "warmstart.env=null", "data.eval_every=2",
                                        "log.sample_every=2", "env.args.agent=two_api_agent:by_task_id",
                                        f"run.python_path=['.', '{Path(__file__).parent}']",
                                        # one small round is enough to show the eval worker runs agents
                                        "data.eval=[{name: held_out, split: eval, max_tasks: 8, "
                                        "sampling: {temperature: 1.0, max_new_tokens: 16}}]",
                                        config="configs/calculator_agent.yaml"),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "calculator_agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["success_before"] is not None and summary["success_after"] is not None
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3] and all(m["trajectories"] == 8 for m in metrics)
    assert "## version 2" in (run / "samples.md").read_text()
    assert (run / "eval.jsonl").read_text().strip()  # the eval worker ran agent episodes too
    # no episode of either API failed, in the rollout, the success checks or the evaluation
    assert summary["errors"]["counts"] == {}, summary["errors"]
    rounds = [summary[when][f"{mode}_metrics"] for when in ("success_before", "success_after")
              for mode in ("sampled", "greedy")]
    rounds += [{k.removeprefix("eval/held_out/"): v for k, v in r.items()} for r in summary["eval"]]
    assert all(r.get("stop/env_error", 0) == 0 and r["metric/reward_errors"] == 0 for r in rounds), rounds
    with contextlib.closing(sqlite3.connect(run / "trajectories.sqlite")) as db:
        trained = db.execute("SELECT task_id, stop_reason, completion_tokens, turns FROM trajectories").fetchall()
    assert len(trained) == 24 and all(stop != "env_error" for _, stop, _, _ in trained)
    # both APIs trained: `run` leaves max_tokens to the run (16 here); `run_anthropic` asks for 48 per reply
    messages = [(tokens, turns) for task, _, tokens, turns in trained if uses_messages_api(task)]
    chat = [(tokens, turns) for task, _, tokens, turns in trained if not uses_messages_api(task)]
    assert messages and chat and all(tokens <= 16 * turns for tokens, turns in chat)
    assert any(tokens > 16 * turns for tokens, turns in messages)


def test_train_runs_every_part_evaluates_beside_training_and_accounts_for_every_trajectory(tmp_path: Path) -> None:
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": f"Say {i}.", "label": ".*"}) + "\n" for i in range(3)))
    evals = (f"data.eval=[{{name: s, source: jsonl, path: '{suite}', env: {{name: 'envs.chat:ChatEnv', "
             "args: {verifier: regex}}}]")
    done = subprocess.run(train_command(tmp_path, "train.steps=3", "log.sample_every=2", "data.eval_every=2", evals),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "local"
    assert "run summary" in done.stdout and "success before RL" in done.stdout
    # into a pipe (a log file) each phase still says what it is doing, where a spinner would draw nothing
    assert "measuring success on 8 held-out problems" in done.stdout and "measuring success after RL" in done.stdout
    config = (run / "config.yaml").read_text()
    assert "/warmstart/" in config  # every part started from the warm-started model
    samples = (run / "samples.md").read_text()
    assert "## version 2" in samples and "<|im_start|>assistant" in samples and "reward " in samples
    assert list((run / "tensorboard" / "train").glob("events.out.tfevents.*"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["max_staleness"] <= 2 for m in metrics)  # eta = 2 in configs/local.yaml
    assert metrics[0]["ratio_min"] == pytest.approx(1.0, abs=1e-5)  # on-policy first step
    summary = json.loads((run / "summary.json").read_text())
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"] and b["trained"] >= 24
    for key in ("success_before", "success_after"):
        assert summary[key]["tasks"] == 8 and 0.0 <= summary[key]["sampled"] <= 1.0
        for mode in ("sampled", "greedy"):  # the whole round is kept: mean reward, the env's metrics
            round_ = summary[key][f"{mode}_metrics"]
            assert round_["num_tasks"] == 8 and round_["pass@1"] == summary[key][mode]
            assert 0.0 <= round_["metric/answered"] <= 1.0
    assert summary["warmstart"]["demonstrations"] == 64 and summary["warmstart"]["steps"] == 2  # batches of 32
    (worker,) = summary["rollout"]  # the rollout worker's own figures reached the launcher
    assert worker["sent"] == b["received"] > 0 and worker["in_flight"] == 0
    assert "DONE" in (run / "logs" / "rollout-0.log").read_text() and "balanced=True" in (
        run / "logs" / "rollout-0.log").read_text()
    # the evaluation beside training: a baseline before the first step, then rounds in version order
    rounds = summary["eval"]
    assert rounds and rounds[0]["version"] == 0
    assert [r["version"] for r in rounds] == sorted(r["version"] for r in rounds)
    assert all(r["eval/s/num_tasks"] == 3 and "eval/s/pass@1" in r for r in rounds)
    assert processes_mentioning(str(run / "config.yaml")) == []  # nothing left running


def test_an_moe_model_trains_through_every_part_with_the_engines_routing_replayed(tmp_path: Path) -> None:
    """configs/local_moe.yaml: the embedded engine returns each token's experts with its completion, they
    travel through the rollout worker and the buffer with the trajectory, and the trainer replays them."""
    done = subprocess.run(train_command(tmp_path, "train.steps=3", "warmstart.check_tasks=0",  # not asserted here
                                        config="configs/local_moe.yaml"),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "local_moe"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        # present only when every batch carried the engine's routes (a step without them logs no mismatch)
        assert 0.0 <= m["moe/route_mismatch"] <= 1.0 and m["moe/aux_loss"] > 0.0
        assert m["counters"].get("unrouted_rows", 0) == 0
    summary = json.loads((run / "summary.json").read_text())
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"] and b["trained"] >= 24


def test_killed_trainer_is_restarted_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    proc = start_training(train_command(tmp_path, "train.steps=6", "train.checkpoint_every=1",
                                        "warmstart.check_tasks=0"))  # the success checks: not asserted here
    run = tmp_path / "local"
    metrics_path = run / "metrics.jsonl"
    try:
        wait_for_steps(proc, metrics_path, 2)
        trainers = [p for p in processes_mentioning("slime_async.train.worker") if str(run) in
                    Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert len(trainers) == 1
        os.kill(trainers[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and, through PDEATHSIG, its children
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert any("trainer died" in e for e in summary["events"]) and any("trainer restarted" in e for e in
                                                                       summary["events"])
    versions = [json.loads(line)["version"] for line in metrics_path.read_text().splitlines()]
    assert versions == list(range(1, 7))  # a step undone by the restart leaves the record with it
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"]
    assert "resumed=True" in (run / "logs" / "trainer.log").read_text()
    assert processes_mentioning(str(run / "config.yaml")) == []


def command_lines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
    return out


def test_train_stops_before_rl_when_the_start_model_rarely_succeeds(tmp_path: Path) -> None:
    # The random tiny model (no warm-start) never solves a problem: a floor of 50% must stop the
    # run with one clear line, before any part starts.
    done = subprocess.run(train_command(tmp_path, "warmstart.enabled=false", "warmstart.min_success=0.5"),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "warmstart.min_success" in done.stderr and "below the floor 50.0%" in done.stderr
    assert not (tmp_path / "local" / "metrics.jsonl").exists()
    assert processes_mentioning(str(tmp_path / "local" / "config.yaml")) == []
