"""Building an engine from a model directory and serving it until interrupted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from pathlib import Path

import torch
from aiohttp import web

from slime_async.engine.core import Engine
from slime_async.engine.server import EngineServer
from slime_async.types.oom import OUT_OF_MEMORY_EXIT


def load_engine(model_path: str | Path, device: str = "auto", dtype: str = "float32", max_batch_size: int = 32,
                seed: int = 0, context_length: int | None = None, weight_version: str = "0",
                cuda_graphs: bool = True) -> Engine:
    """Load tokenizer and model with transformers and wrap them in an `Engine` (dense models of the
    Llama family, and Qwen3-MoE: `slime_async.moe.shape` refuses any other MoE layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from slime_async.moe.shape import moe_shape

    hf_logging.disable_progress_bar()
    # an MoE layout the engine does not compute is one error naming the config field, before any weights load
    moe_shape(AutoConfig.from_pretrained(str(model_path)), "model_path")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype)).to(device)
    return Engine(model, tokenizer, max_batch_size=max_batch_size, seed=seed, context_length=context_length,
                  weight_version=weight_version, cuda_graphs=cuda_graphs)


def serve(engine: Engine, model_path: str, host: str = "127.0.0.1", port: int = 30000,
          admin_token: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Prints `serving on http://HOST:PORT` once bound (port 0 picks one)."""
    server = EngineServer(engine, model_path, host=host, admin_token=admin_token)

    async def main() -> None:
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        # the engine's loop stopped for good (out of memory): the process ends, and says why
        engine.on_fatal = lambda _why: loop.call_soon_threadsafe(stopped.set)
        # handler_cancellation: a client that disconnects cancels its handler, whose generation is
        # then aborted (`EngineServer._run`); aiohttp's default lets it decode to the end for nobody
        runner = web.AppRunner(server.app, handle_signals=True, handler_cancellation=True)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        site = web.SockSite(runner, sock)
        await site.start()
        bound = sock.getsockname()[1]
        print(f"serving on http://{host}:{bound}", flush=True)
        sys.stdout.flush()
        try:
            await stopped.wait()
        finally:
            await runner.cleanup()
            engine.shutdown()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    if engine.fatal is not None:
        print(f"error: {engine.fatal}", file=sys.stderr, flush=True)
        sys.exit(OUT_OF_MEMORY_EXIT)
