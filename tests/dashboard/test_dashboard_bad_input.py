"""Bad input to the dashboard: one clear error each (the real CLI, a real port, real HTTP)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from slime_async.dashboard.run_view import open_runs
from slime_async.dashboard.server import Dashboard, DashboardError, start
from slime_async.rundir.run_files import RunDirError, parse_jsonl

REPO = Path(__file__).resolve().parents[2]


def dashboard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_async.cli", "dashboard", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def make_run(path: Path, lines: list[str], finished: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run: {name: x}\n")
    (path / "metrics.jsonl").write_text("".join(lines))
    if finished:
        (path / "summary.json").write_text("{}")
    return path


def step(v: int) -> str:
    return json.dumps({"version": v, "reward_mean": 0.5, "seconds": 1.0, "trajectories": 8, "time": 100.0 + v}) + "\n"


def test_a_directory_that_is_not_a_run_is_refused_with_the_way_out(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "a", [step(1)])
    done = dashboard_cli(str(tmp_path / "runs"), "--port", "0")
    assert done.returncode == 2
    assert "not a run directory" in done.stderr and "give one of those" in done.stderr and " a" in done.stderr
    missing = dashboard_cli(str(tmp_path / "nowhere"), "--port", "0")
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_a_truncated_metrics_file_names_the_file_and_line(tmp_path: Path) -> None:
    run = make_run(tmp_path / "cut", [step(1), step(2)[:20] + "\n", step(3)])
    done = dashboard_cli(str(run), "--port", "0")
    assert done.returncode == 2
    assert f"{run / 'metrics.jsonl'}: line 2 is not JSON" in done.stderr
    # a live run's last line without its newline is being written: not an error, and not read yet
    data = (step(1) + step(2)[:20]).encode()
    assert [r["version"] for r in parse_jsonl(data, run / "metrics.jsonl", live=True)] == [1]
    with pytest.raises(RunDirError, match="line 2"):
        parse_jsonl(data, run / "metrics.jsonl", live=False)


def test_a_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", [step(1)])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = dashboard_cli(str(run), "--port", str(port))
    assert done.returncode == 2
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in done.stderr and "choose another port" in done.stderr


async def test_off_loopback_every_request_needs_the_token(tmp_path: Path) -> None:
    runs = open_runs([make_run(tmp_path / "r", [step(1), step(2)])])
    with pytest.raises(DashboardError, match="needs a token"):
        await start(Dashboard(runs), "0.0.0.0", 0)
    runner, url = await start(Dashboard(runs, token="s3cret"), "0.0.0.0", 0)
    local = url.replace("0.0.0.0", "127.0.0.1")
    try:
        # unsafe: keep cookies from an IP address, as a browser does (aiohttp's jar does not by default)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            for path in ("", "api/runs", "api/runs/0/snapshot", "static/app.js"):
                async with http.get(local + path) as r:
                    assert r.status == 401, path
            async with http.get(local + "api/runs?token=wrong") as r:
                assert r.status == 401
            async with http.get(local + "?token=s3cret") as r:  # the printed URL: then a cookie
                assert r.status == 200 and "slime-async" in await r.text()
            async with http.get(local + "api/runs/0/snapshot") as r:
                assert r.status == 200 and (await r.json())["metrics"]["version"] == [1.0, 2.0]
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer s3cret"}) as http, \
                http.get(local + "api/runs/0/trajectories?sort=nonsense") as r:
            assert r.status == 400 and "sort must be one of" in await r.text()
    finally:
        await runner.cleanup()
