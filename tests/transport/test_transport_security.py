"""Loopback by default; CURVE required, and enforced, off loopback; `slime-async keys`."""

from __future__ import annotations

from pathlib import Path

import pytest
from transport_helpers import make_trajectory, server_thread
from typer.testing import CliRunner

from slime_async.buffer import BufferClient, BufferServer, ServerSettings
from slime_async.cli.main import app
from slime_async.config.schema import BufferConfig
from slime_async.transport import InsecureEndpointError, SyncSender, generate_keys, is_loopback


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:0", True), ("tcp://localhost:1", True),
        ("tcp://[::1]:5555", True), ("ipc:///tmp/x.sock", True), ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.7:5555", False),
        ("tcp://eth0:5555", False), ("tcp://buffer.example.com:5555", False),
    ],
)
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_off_loopback_without_keys_is_refused_on_both_sides() -> None:
    with pytest.raises(InsecureEndpointError, match=r"buffer\.curve_dir"):
        BufferServer(ServerSettings(buffer=BufferConfig(endpoint="tcp://0.0.0.0:0"), group_size=1, max_staleness=1))
    with pytest.raises(InsecureEndpointError, match="slime-async keys"):
        SyncSender("tcp://10.0.0.7:5555")
    with pytest.raises(InsecureEndpointError):
        BufferClient("tcp://10.0.0.7:5555")


def test_curve_server_admits_its_clients_only(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    stranger = generate_keys(tmp_path / "stranger")
    (stranger.dir / "server.key").write_bytes(keys.server_public.read_bytes())  # knows the server, not admitted
    with server_thread(endpoint="tcp://0.0.0.0:0", curve_dir=str(keys.dir)) as server:
        endpoint = "tcp://127.0.0.1:" + server.endpoint.rsplit(":", 1)[1]
        with SyncSender(endpoint, curve_dir=keys.dir) as sender:
            sender.send(make_trajectory(1))
            sender.flush(10)
            assert sender.stats.acked == 1
        for curve_dir in (None, stranger.dir):  # plain ZMTP, then an unknown client key
            with SyncSender(endpoint, curve_dir=curve_dir) as intruder, pytest.raises(TimeoutError):
                intruder.send(make_trajectory(2), timeout=1.5)
        with BufferClient(endpoint, curve_dir=keys.dir) as client:
            m = client.metrics()
        assert m["received"] == 1 and m["sessions"] == 1  # the intruders never even said HELLO


def test_keys_command(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["keys", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    for name in ("server.key", "server.key_secret", "clients/client.key", "clients/client.key_secret"):
        assert (tmp_path / "k" / name).is_file()
    again = runner.invoke(app, ["keys", str(tmp_path / "k")])
    assert again.exit_code == 2
