"""The admin token reaches an engine by its environment or a file, never by its command line (which
every user of the machine can read in /proc)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from slime_async.config import load_config
from slime_async.config.schema import ADMIN_TOKEN_ENV
from slime_async.launch.local import engine_args, engine_env
from slime_async.launch.process import start_engine

TOKEN = "3f9c2d-admin"


async def update_version(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/update_weight_version", json={"new_version": "4"},
                                                    headers=headers) as r:
        return r.status


@pytest.mark.parametrize("how", ["launcher", "file"])
async def test_the_token_is_guarded_and_not_on_the_command_line(tiny_model_dir: Path, tmp_path: Path,
                                                                how: str) -> None:
    cfg = load_config(None, [f"engine.admin_token={TOKEN}"])
    if how == "launcher":  # what `slime-async train` starts
        server = start_engine(tiny_model_dir, *engine_args(cfg, 0), env=engine_env(cfg))
    else:
        secret = tmp_path / "token"
        secret.write_text(TOKEN + "\n")
        secret.chmod(0o600)
        server = start_engine(tiny_model_dir, "--admin-token-file", str(secret))
    try:
        assert TOKEN not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert await update_version(server.url, None) == 401
        assert await update_version(server.url, TOKEN) == 200
    finally:
        server.stop()
    assert engine_env(cfg) == {ADMIN_TOKEN_ENV: TOKEN}
