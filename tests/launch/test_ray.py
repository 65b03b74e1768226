"""Cluster mode on a local Ray instance (2 CPUs): every part a Ray actor, and parts killed mid-run.

The runs are the embedded default made small (a few steps of 8 trajectories of at most 16 tokens);
Ray's logical CPUs are shared out in fractions so that all parts fit on this machine's two cores.
Everything binds to loopback (`launch.ray.host=127.0.0.1`). Ray is given one logical GPU, so that
the colocated layout can be placed; the processes still compute on CPU.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from slime_async.config import Config, load_config

ray = pytest.importorskip("ray")
# about a minute each on an idle 2-core machine; several times that when the cores are shared
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.batch_size=8", "rollout.group_size=4", "rollout.filter_equal_rewards=false",
         "rollout.sampling.max_new_tokens=16", "engine.port=0", "launch.ray.host=127.0.0.1", "launch.ray.engine.gpus=0",
         "launch.ray.trainer.gpus=0", "launch.ray.engine.cpus=0.5", "launch.ray.trainer.cpus=0.5",
         "launch.ray.rollout.cpus=0.25", "launch.ray.buffer.cpus=0.25", "model.device=cpu",
         "warmstart.enabled=false", "warmstart.check_tasks=0", "data.eval_every=0"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # one logical GPU (there is none): enough for Ray to place a colocated layout and name "GPU 0"
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def small_config(run_dir: Path, *extra: str) -> Config:
    return load_config(REPO / "configs/local.yaml", [*SMALL, f"run.dir={run_dir}", *extra])


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def handshake_completes(endpoint: str, timeout_ms: int = 3000) -> bool:
    """Whether a ZeroMQ client without CURVE keys gets a connection to `endpoint` (IMMEDIATE: a send
    waits for a completed handshake, and times out without one)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(b"")
        return True
    except zmq.Again:
        return False
    finally:
        sock.close()


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_embedded_default_runs_with_every_part_a_ray_actor(cluster: None, tmp_path: Path) -> None:
    from slime_async.launch.train_run import train

    # distilling from a teacher (the tiny model again: what it scores is not the point here) that the
    # launcher starts as an actor of its own
    cfg = small_config(tmp_path, "train.steps=3", "train.distill.model=tiny", "launch.ray.teacher.gpus=0",
                       "launch.ray.teacher.cpus=0.25")
    summary = train(cfg, overwrite=True, console=Console(file=io.StringIO()), ray="")
    run = tmp_path / "local"
    assert [m["version"] for m in metrics(run)] == [1, 2, 3]
    assert metrics(run)[0]["ratio_min"] == pytest.approx(1.0, abs=1e-5)  # on-policy first step
    assert set(summary["parts"]) == {"buffer", "engine-0", "trainer", "rollout-0", "teacher"}
    assert all(where.startswith("actor local.") for where in summary["parts"].values())
    books = summary["rollout"][0]["distill"]  # the worker asked the teacher's actor for every trajectory
    assert books["scored"] >= 24 and books.get("teacher_unavailable", 0) == 0, books
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"] and b["trained"] >= 24
    logs = run / "logs"
    assert "joined tcp://127.0.0.1:" in (logs / "trainer.log").read_text()  # torch.distributed, world size 1
    assert "--weight-version 0" in (logs / "engine-0.log").read_text().splitlines()[0]
    assert "balanced=True" in (logs / "rollout-0.log").read_text()
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_vllm_engine_runs_as_a_ray_actor_and_serves_a_lora_run_s_adapters(cluster: None, tmp_path: Path) -> None:
    from slime_async.launch.train_run import train

    # eager: vLLM's graph capture (the config's default, kept by tests/vllm) costs 20-50 s a start.
    # LoRA: the engine loads the launcher's zero adapters, then each step's adapters, by name
    cfg = load_config(REPO / "configs/local_vllm.yaml", [*SMALL, f"run.dir={tmp_path}", "train.steps=3",
                                                          "vllm.args.max_model_len=512", "vllm.args.enforce_eager=true",
                                                          "rollout.max_staleness=0", "train.lora={rank: 8}",
                                                          "train.lr=1e-2"])
    summary = train(cfg, overwrite=True, console=Console(file=io.StringIO()), ray="")
    run = tmp_path / "local_vllm"
    records = metrics(run)
    assert [m["version"] for m in records] == [1, 2, 3]
    assert all(m["max_abs_dp"] < 1e-3 for m in records), [m["max_abs_dp"] for m in records]  # eta 0: agree
    assert all(m["publish_bytes"] == records[0]["publish_bytes"] < 1_000_000 for m in records)  # adapters alone
    assert summary["parts"]["engine-0"].startswith("actor local_vllm.engine-0")
    log = (run / "logs" / "engine-0.log").read_text()
    assert "vllm.entrypoints.openai.api_server" in log.splitlines()[0]
    # vLLM's own words: the zero adapters at its start, then each step's (what it serves is checked against
    # the trainer's model in tests/vllm/test_vllm_client.py)
    loaded = re.findall(r"Loaded new LoRA adapter: name 'policy', path '([^']+)'", log)
    assert [Path(p).name for p in loaded] == ["lora-zero", "v1", "v2", "v3"], loaded


def test_killed_engine_rollout_and_trainer_actors_are_replaced_and_the_run_completes(
    cluster: None, tmp_path: Path
) -> None:
    from slime_async.launch.ray_launcher import RayLauncher
    from slime_async.launch.train_run import buffer_counts, prepare_run_dir

    cfg = small_config(tmp_path, "train.steps=5", "train.checkpoint_every=1", "train.batch_timeout_s=1")
    run_dir, config_path = prepare_run_dir(cfg, resume=False, overwrite=True)
    launcher = RayLauncher(cfg, config_path, run_dir)
    events: list[str] = []
    launcher.start(on_event=events.append)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 1, 300, "the first step")
        engine = launcher.part("engine-0").child
        ray.kill(launcher.part("engine-0").child.actor)  # type: ignore[union-attr]
        ray.kill(launcher.part("rollout-0").child.actor)  # type: ignore[union-attr]
        wait_for(lambda: (launcher.check() or True) and launcher.part("engine-0").child is not engine, 300,
                 "the engine's replacement")
        assert launcher.part("engine-0").child.url == engine.url  # type: ignore[union-attr]  # same address
        steps_before = len(metrics(run_dir))
        wait_for(lambda: (launcher.check() or True) and len(metrics(run_dir)) > steps_before, 300,
                 "a step after the replacements")
        ray.kill(launcher.part("trainer").child.actor)  # type: ignore[union-attr]
        launcher.supervise(lambda: False, interval=0.5)  # restarts the trainer, returns when it finished
        launcher.stop_rollout()
        counts = buffer_counts(launcher)  # with the driver's copy of the run's CURVE keys
        assert not handshake_completes(launcher.buffer_endpoint)  # without them, no connection
        from slime_async.sync import WeightPublisher

        async def engine_version() -> int | None:
            async with WeightPublisher([engine.url], cfg.sync) as publisher:
                return await publisher.engine_version(engine.url)

        import asyncio

        final_engine_version = asyncio.run(engine_version())
    finally:
        launcher.shutdown()
    for part in ("engine-0", "rollout-0", "trainer"):
        died = [e for e in events if e.startswith(f"{part} lost its Ray actor")]
        assert died and "last lines of" in died[0], events
        assert f"{part} restarted (1/3)" in events
    versions = [m["version"] for m in metrics(run_dir)]
    assert versions[-1] == 5 and sorted(set(versions)) == [1, 2, 3, 4, 5]
    assert counts is not None and counts["received"] == counts["trained"] + counts["buffered"] + counts["dropped_total"]
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert engine_log.count("$ ") == 2 and "--weight-version pending" in engine_log.split("$ ")[2]
    assert final_engine_version == 5  # the replacement was brought to the trainer's version
    assert "resumed=True" in (run_dir / "logs" / "trainer.log").read_text()
    assert not launcher.actors


def test_colocated_engine_shares_the_trainers_gpu_and_gives_its_memory_back_each_step(
    cluster: None, tmp_path: Path
) -> None:
    from slime_async.launch.train_run import train

    cfg = small_config(tmp_path, "train.steps=3", "launch.ray.layout=colocated", "launch.ray.engine.gpus=1",
                       "launch.ray.trainer.gpus=1")
    summary = train(cfg, overwrite=True, console=Console(file=io.StringIO()), ray="")
    run = tmp_path / "local"
    assert [m["version"] for m in metrics(run)] == [1, 2, 3]
    parts = summary["parts"]
    assert parts["engine-0"].endswith("(bundle 0, GPUs 0)") and parts["trainer"].endswith("(bundle 0, GPUs 0)")
    assert "bundle 0, GPUs" not in parts["rollout-0"]
    # released before each step's GPU work, taken back with the step's weights (sync.release_memory)
    assert (run / "logs" / "engine-0.log").read_text().count("released all") == 3
    b = summary["buffer"]
    assert b["received"] == b["trained"] + b["buffered"] + b["dropped_total"]
