"""A minimal inference server for orchestration benchmarks: it answers at once with fixed replies.

It speaks SGLang's `/generate` (token ids in and out, logprobs, weight versions) and an
OpenAI-compatible `/v1/chat/completions`, and for the calculator task it always gives the same
two-turn episode: first a call of `calculate`, then (once a tool response is in the conversation)
the final answer. Both endpoints return the same replies, so two orchestrators driving it do the
same work per turn. `--latency-ms` adds a fixed (or, with `--lognormal`, long-tailed) delay.

`python -m benchmarks.minimal_server --model DIR [--port 0] [--latency-ms 0]` prints `serving on URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import socket

from aiohttp import web

TOOL_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12*34+5"}}</tool_call>'
ANSWER = "The answer is 413."


class MinimalServer:
    def __init__(self, model_dir: str, latency_ms: float = 0.0, lognormal: bool = False, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.tool_response_id = tok.convert_tokens_to_ids("<tool_response>")
        self.call_ids = [*tok.encode(TOOL_CALL, add_special_tokens=False), eos]
        self.answer_ids = [*tok.encode(ANSWER, add_special_tokens=False), eos]
        self.eos = eos
        self.latency = latency_ms / 1000
        self.lognormal = lognormal
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.requests = 0

    async def _delay(self) -> None:
        if self.latency <= 0:
            return
        # lognormal with sigma 1: p99 is about 10x the median, the long tail of tool-using episodes
        await asyncio.sleep(self.rng.lognormvariate(0, 1) * self.latency if self.lognormal else self.latency)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        await self._delay()
        prompt = body.get("input_ids") or []
        out = self.answer_ids if self.tool_response_id in prompt else self.call_ids
        n = len(out)
        meta = {
            "id": body.get("rid") or str(next(self.ids)), "finish_reason": {"type": "stop", "matched": self.eos},
            "prompt_tokens": len(prompt), "completion_tokens": n, "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "weight_version": "0", "weight_versions": [{"version": "0", "start": 0, "end": n}],
        }
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        await self._delay()
        answered = any(m.get("role") == "tool" for m in body.get("messages", []))
        if answered:
            message = {"role": "assistant", "content": ANSWER}
            finish, n = "stop", len(self.answer_ids)
        else:
            call = {"id": f"call_{next(self.ids)}", "type": "function",
                    "function": {"name": "calculate", "arguments": json.dumps({"expression": "12*34+5"})}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish, n = "tool_calls", len(self.call_ids)
        return web.json_response({
            "id": f"chatcmpl-{next(self.ids)}", "object": "chat.completion", "created": 0,
            "model": body.get("model", "tiny"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 50, "completion_tokens": n, "total_tokens": 50 + n},
        })

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "0", "model_path": "minimal"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.ok)
        app.router.add_get("/get_model_info", self.ok)
        return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.minimal_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--lognormal", action="store_true")
    args = parser.parse_args()
    server = MinimalServer(args.model, args.latency_ms, args.lognormal)

    async def run() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", args.port))
        await web.SockSite(runner, sock, backlog=4096).start()
        print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
