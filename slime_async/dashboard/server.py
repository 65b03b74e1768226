"""The dashboard's HTTP server (aiohttp): the page, its static files, and a small JSON API.

Routes (`i` is the run's position on the command line):
- `GET /` the page; `GET /static/...` its scripts, styles and the vendored chart library;
- `GET /api/runs` the runs; `GET /api/runs/{i}/snapshot` every series the charts draw (polled);
- `GET /api/runs/{i}/trajectories?offset&limit&sort&step_min&step_max&reward_min&reward_max&stop_reason&env
  &task_id&group_id&text` one page of trajectories and the total that match;
  `GET /api/runs/{i}/facets` what the filters offer;
- `GET /api/runs/{i}/trajectories/{id}` one trajectory, token by token; `GET /api/runs/{i}/groups/{group_id}`;
- `GET /api/runs/{i}/export/{id}` writes the export file into the run and sends it (for `slime-async replay`).

It reads only: SQLite and the run's files, off the event loop (a thread per request, a store
connection per thread). It listens on loopback unless told otherwise; elsewhere every request needs
the token (`?token=` once, then a cookie; or `Authorization: Bearer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from slime_async.config.schema import is_loopback_host
from slime_async.dashboard.run_view import RunView
from slime_async.dashboard.store import SORTS, Filters, StoreError, TrajectoryStore
from slime_async.dashboard.trajectory_view import detail, export_document, write_export
from slime_async.rundir.run_files import RunDirError

STATIC = Path(__file__).parent / "static"
_COOKIE = "slime_async_dashboard"
ROLLOUT_SAMPLE_S = 2.0


class DashboardError(RuntimeError):
    """The server cannot start as asked (a port in use, a token missing); the message says the fix."""


class _Stores(threading.local):
    """One read-only store connection per run in each worker thread (SQLite objects stay in their thread)."""

    def __init__(self) -> None:
        self.by_run: dict[int, TrajectoryStore] = {}


def _filters(q: Any) -> Filters:
    def num(name: str, kind: type) -> Any:
        value = q.get(name)
        if value in (None, ""):
            return None
        try:
            return kind(value)
        except ValueError:
            raise web.HTTPBadRequest(text=f"query parameter {name}: {value!r} is not a {kind.__name__}") from None

    return Filters(step_min=num("step_min", int), step_max=num("step_max", int), reward_min=num("reward_min", float),
                   reward_max=num("reward_max", float), stop_reason=q.get("stop_reason") or None,
                   env=q.get("env") or None, task_id=q.get("task_id") or None, group_id=q.get("group_id") or None,
                   text=q.get("text") or None)


class Dashboard:
    """The app over a list of runs. `token` None: no check (loopback only; `serve` enforces that)."""

    def __init__(self, runs: list[RunView], token: str | None = None) -> None:
        self.runs = runs
        self.token = token
        self._stores = _Stores()
        self.app = web.Application(middlewares=[self._auth])
        self.app.cleanup_ctx.append(self._sample_rollout)
        r = self.app.router
        r.add_get("/", self._index)
        r.add_static("/static/", STATIC, follow_symlinks=False)
        r.add_get("/api/runs", self._runs)
        r.add_get("/api/runs/{i}/snapshot", self._snapshot)
        r.add_get("/api/runs/{i}/facets", self._facets)
        r.add_get("/api/runs/{i}/trajectories", self._list)
        r.add_get("/api/runs/{i}/trajectories/{id}", self._one)
        r.add_get("/api/runs/{i}/groups/{group_id}", self._group)
        r.add_get("/api/runs/{i}/export/{id}", self._export)

    async def _sample_rollout(self, app: web.Application) -> Any:
        """Sample live runs' rollout figures every few seconds, page open or not: the workers keep only
        their latest, so the history a page shows is what this server saw since it started."""

        async def loop() -> None:
            while True:
                for run in self.runs:
                    if not run.finished:
                        await asyncio.to_thread(run.rollout)
                await asyncio.sleep(ROLLOUT_SAMPLE_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # -- plumbing --------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token is None:
            return await handler(request)
        given = request.query.get("token") or request.cookies.get(_COOKIE) or ""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:]
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise web.HTTPUnauthorized(text="this dashboard needs its token: open the URL it printed (…?token=…)")
        response = await handler(request)
        if request.query.get("token"):  # the page's own requests then carry the cookie
            response.set_cookie(_COOKIE, self.token, httponly=True, samesite="Strict")
        return response

    def _run(self, request: web.Request) -> tuple[int, RunView]:
        try:
            i = int(request.match_info["i"])
            return i, self.runs[i]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['i']!r} (there are {len(self.runs)})") from None

    def _store(self, i: int) -> TrajectoryStore:
        store = self._stores.by_run.get(i)
        if store is None:
            store = self._stores.by_run[i] = TrajectoryStore(self.runs[i].path)
        return store

    async def _call(self, fn: Any, *args: Any) -> Any:
        """Run blocking reads in a thread; a damaged file or store is a 409 naming it, a missing id 404."""
        try:
            return await asyncio.to_thread(fn, *args)
        except (RunDirError, StoreError) as exc:
            raise web.HTTPConflict(text=str(exc)) from None
        except KeyError as exc:
            raise web.HTTPNotFound(text=f"no trajectory {exc.args[0]!r} in this run") from None

    @staticmethod
    def _json(data: Any) -> web.Response:
        return web.Response(text=json.dumps(data, allow_nan=False, default=str), content_type="application/json")

    # -- handlers --------------------------------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _runs(self, request: web.Request) -> web.Response:
        return self._json([{"index": i, "name": r.name, "path": str(r.path), "live": not r.finished}
                           for i, r in enumerate(self.runs)])

    async def _snapshot(self, request: web.Request) -> web.Response:
        i, run = self._run(request)
        return self._json(_finite(await self._call(lambda: run.snapshot(self._store(i)))))

    async def _facets(self, request: web.Request) -> web.Response:
        i, _ = self._run(request)
        if not self.runs[i].path.joinpath("trajectories.sqlite").exists():
            return self._json({"count": 0, "stop_reasons": {}, "envs": {}, "step_min": None, "step_max": None})
        return self._json(await self._call(lambda: self._store(i).facets()))

    async def _list(self, request: web.Request) -> web.Response:
        i, run = self._run(request)
        q = request.query
        filters = _filters(q)
        try:
            offset, limit = int(q.get("offset", 0)), int(q.get("limit", 50))
        except ValueError:
            raise web.HTTPBadRequest(text="offset and limit must be integers") from None
        sort = q.get("sort", "step")
        if sort not in SORTS or not 0 < limit <= 1000 or offset < 0:
            raise web.HTTPBadRequest(text=f"sort must be one of {', '.join(SORTS)}, limit 1..1000, offset >= 0 "
                                          f"(got {sort!r}, {limit}, {offset})")
        if not run.path.joinpath("trajectories.sqlite").exists():
            return self._json({"total": 0, "rows": [], "note": "no trajectories recorded yet (log.trajectories)"})

        def page() -> dict[str, Any]:
            store = self._store(i)
            return {"total": store.count(filters), "rows": store.page(filters, sort=sort, offset=offset, limit=limit)}

        return self._json(_finite(await self._call(page)))

    async def _one(self, request: web.Request) -> web.Response:
        i, run = self._run(request)
        traj_id = request.match_info["id"]
        return self._json(_finite(await self._call(lambda: detail(self._store(i), traj_id, run.path))))

    async def _group(self, request: web.Request) -> web.Response:
        i, _ = self._run(request)
        return self._json(_finite(await self._call(lambda: self._store(i).group(request.match_info["group_id"]))))

    async def _export(self, request: web.Request) -> web.Response:
        i, run = self._run(request)
        traj_id = request.match_info["id"]

        def export() -> dict[str, Any]:
            store = self._store(i)
            with contextlib.suppress(OSError):  # a read-only run directory: the download is the export
                write_export(store, traj_id, run.path)
            return export_document(store, traj_id, run.path)

        doc = await self._call(export)
        return web.Response(text=json.dumps(doc, indent=1), content_type="application/json",
                            headers={"Content-Disposition": f'attachment; filename="{traj_id}.json"'})


def _finite(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither; a NaN logprob is possible)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


async def start(dashboard: Dashboard, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0: a free port); returns the runner and the URL. DashboardError when the
    port is taken, or when the host is not loopback and the dashboard has no token."""
    if not is_loopback_host(host) and dashboard.token is None:
        raise DashboardError(f"--host {host}: off loopback the dashboard needs a token "
                             "($SLIME_ASYNC_DASHBOARD_TOKEN, or let it make one)")
    runner = web.AppRunner(dashboard.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=False)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise DashboardError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                             "choose another port, or 0 for a free one") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}/"
