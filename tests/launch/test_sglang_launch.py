"""The launcher's SGLang path end to end, with a stand-in server (tests/launch/fake_sglang): the
`sglang:` section reaches the server's command line, health waits, sglang-router in front of the
engines, and a killed engine replaced and brought to the trainer's version."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from slime_async.config import load_config
from slime_async.launch.local import LocalLauncher
from slime_async.launch.train_run import buffer_counts, prepare_run_dir
from slime_async.sync import WeightPublisher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent


async def router_workers(url: str) -> dict[str, bool]:
    async with aiohttp.ClientSession() as session, session.get(url + "/workers") as resp:
        return {w["url"]: w["is_healthy"] for w in (await resp.json())["workers"]}


def test_sglang_engines_behind_the_router_with_a_replaced_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 varied_model_dir: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", str(HERE / "fake_sglang"))  # the children's `sglang`
    cfg = load_config(HERE.parents[1] / "configs/local.yaml", [
        f"run.dir={tmp_path}", f"model.path={varied_model_dir}", "engine.kind=sglang", "engine.port=0",
        "rollout.partial_mode=abort",  # local.yaml's in_place is refused with SGLang (its radix cache)
        "engine.router.enabled=true", "engine.router.args={health_check_interval_secs: 1, log_level: warn}",
        "sglang.mem_fraction_static=0.5", "sglang.enable_torch_compile=true", "train.steps=4",
        "train.checkpoint_every=1", "train.batch_timeout_s=1", "rollout.batch_size=8", "rollout.group_size=4",
        "rollout.sampling.max_new_tokens=16", "launch.ready_timeout_s=300", "data.eval_every=0",
        "rollout.filter_equal_rewards=false",
    ])
    run_dir, config_path = prepare_run_dir(cfg, resume=False, overwrite=True)
    launcher = LocalLauncher(cfg, config_path, run_dir)
    events: list[str] = []
    launcher.start(on_event=events.append)
    try:
        engine_url, router_url = launcher.engine_urls[0], launcher.rollout_urls[0]
        assert router_url != engine_url
        assert asyncio.run(router_workers(router_url)) == {engine_url: True}
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, "no step within 300 s"
            launcher.check()
            time.sleep(0.2)
        engine = launcher.part("engine-0").child
        engine.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        engine.proc.wait()  # type: ignore[union-attr]
        launcher.supervise(lambda: False, interval=0.5)  # replaces it; returns when the trainer is done
        launcher.stop_rollout()
        counts = buffer_counts(launcher)

        async def version() -> int | None:
            async with WeightPublisher([engine_url], cfg.sync) as publisher:
                return await publisher.engine_version(engine_url)

        final_version = asyncio.run(version())
    finally:
        launcher.shutdown()
    assert "engine-0 restarted (1/3)" in events
    log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "weight version 0, other flags ['--enable-torch-compile', '--mem-fraction-static', '0.5']" in log
    assert "weight version pending" in log  # the replacement waited for the trainer's weights
    assert final_version == 4
    assert [json.loads(line)["version"] for line in metrics.read_text().splitlines()][-1] == 4
    assert counts is not None and counts["received"] == counts["trained"] + counts["buffered"] + counts["dropped_total"]
    assert all(not p.child.alive() for p in launcher.parts)  # type: ignore[union-attr]
