"""A stand-in for SGLang's receiving side of the NCCL weight path, over gloo on CPU (run as a process).

SGLang does not run on CPU machines and the embedded engine answers 501, so this small server
implements just `/init_weights_update_group`, `/update_weights_from_distributed`,
`/pause_generation` and `/continue_generation` with SGLang's request bodies (the engine's `protocol`
structs, which mirror SGLang's `io_struct`), joins the group as rank `rank_offset` and receives each
tensor by broadcast from rank 0, in the listed order. `/received` reports what arrived and the calls
in order. Prints `serving on URL` once bound.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from slime_async.engine import protocol as p
from slime_async.sync.nccl import init_weight_update_group

state: dict[str, Any] = {"group": None, "version": "0", "received": {}, "calls": []}


async def init_group(request: web.Request) -> web.Response:
    req = p.decode_body(await request.read(), p.InitWeightsUpdateGroupReqInput)
    state["group"] = await asyncio.to_thread(
        init_weight_update_group, req.backend, req.master_address, req.master_port, req.rank_offset, req.world_size,
        req.group_name, datetime.timedelta(seconds=60))
    return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})


async def pause(request: web.Request) -> web.Response:
    req = p.decode_body(await request.read(), p.PauseGenerationReqInput)
    state["calls"].append(f"pause {req.mode}")
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def resume(request: web.Request) -> web.Response:
    p.decode_body(await request.read(), p.ContinueGenerationReqInput)
    state["calls"].append("continue")
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush(request: web.Request) -> web.Response:  # SGLang's `/flush_cache?timeout=`: nothing runs here
    state["calls"].append("flush")
    return web.Response(text="Cache flushed.\n")


async def update(request: web.Request) -> web.Response:
    req = p.decode_body(await request.read(), p.UpdateWeightsFromDistributedReqInput)
    state["calls"].append(f"update flush={req.flush_cache}")

    def receive() -> None:
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=state["group"])
            state["received"][name] = t

    await asyncio.to_thread(receive)
    if req.weight_version is not None:
        state["version"] = req.weight_version
    return web.json_response({"success": True, "message": "Succeeded to update parameter online."})


async def model_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": state["version"]})


async def received(request: web.Request) -> web.Response:
    return web.json_response({"calls": state["calls"], "tensors": {
        n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "values": t.float().flatten().tolist()} for n, t in state["received"].items()}})


async def main() -> None:
    app = web.Application(client_max_size=2**30)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/received", received)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
