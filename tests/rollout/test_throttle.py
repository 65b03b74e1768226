"""One warning per condition and period, with a count of those held back."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from slime_async.evaluation.worker import engine_version
from slime_async.rollout.throttle import Throttled


def test_repeats_within_the_period_are_counted_not_logged(caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("slime_async.rollout.throttle.time.monotonic", lambda: now[0])
    warn = Throttled(logging.getLogger("throttle-test"), every_s=10.0)
    with caplog.at_level(logging.WARNING, "throttle-test"):
        assert warn.warning("engine-a ConnectionError", "generate failed (%s)", "a")
        for _ in range(70):  # one engine's death, seen by every request in flight
            assert not warn.warning("engine-a ConnectionError", "generate failed (%s)", "a")
        assert warn.warning("engine-b TimeoutError", "generate failed (%s)", "b")  # another condition
        now[0] += 11
        assert warn.warning("engine-a ConnectionError", "generate failed (%s)", "a")
    assert [r.getMessage() for r in caplog.records] == [
        "generate failed (a)", "generate failed (b)", "generate failed (a) (70 more like it in the last 11 s)"]


async def test_a_pending_engine_is_not_a_version_nor_an_error(caplog: pytest.LogCaptureFixture) -> None:
    versions = {"/a": "3", "/b": "pending"}

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": versions[request.path.removesuffix("/get_model_info")]})

    app = web.Application()
    app.router.add_get("/{engine}/get_model_info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        with caplog.at_level(logging.WARNING):
            async with aiohttp.ClientSession() as session:
                assert await engine_version(session, [url + "/a", url + "/b"]) == 3
                versions["/a"] = "pending"
                assert await engine_version(session, [url + "/a", url + "/b"]) is None
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if "invalid literal" in r.getMessage()]
