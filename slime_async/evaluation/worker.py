"""An evaluation worker process: runs the config's `data.eval` suites beside training, on a schedule.

`python -m slime_async.evaluation.worker CONFIG_YAML --engine URL [--engine URL ...] --out FILE`
prints `READY`, then watches the engines' weight version (`/get_model_info`) and runs every suite
whenever the version reaches the next multiple of `data.eval_every` (version 0 first: the
baseline), appending one JSON line per round to FILE: `{"version": v, "eval/NAME/pass@1": ...}`.
It never blocks training: it only generates, on its own HTTP client, and a round that is still
running when the version moves on simply reports the version it started at (the tokens' versions
are in `eval/NAME/version_min|max`). `--once` runs one round at the current version and exits.
SIGTERM/SIGINT stop it between rounds (a running round is cancelled).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

import aiohttp

from slime_async.agents.server import close_shared_server
from slime_async.config import Config, load_config
from slime_async.config.model_dir import resolve_model_path
from slime_async.data.remote_reward import close_shared_remote_rewards
from slime_async.evaluation.suite import EvalSuite, run_suites, suites_from_config
from slime_async.rollout.throttle import Throttled
from slime_async.rollout.vllm_client import engine_client
from slime_async.train.metrics_log import MetricsLog

log = logging.getLogger("slime_async.evaluation.worker")


def next_due(version: int, every: int) -> int:
    """The next version at which a round is due after one ran at `version`."""
    return (version // every + 1) * every


_WARN = Throttled(log, every_s=60.0)


async def engine_version(session: aiohttp.ClientSession, urls: list[str], path: str = "/get_model_info"
                         ) -> int | None:
    """The lowest weight version the engines report (the policy every engine serves), or None
    when none answers. A replacement engine says `pending` until the trainer brings it up to date:
    not a version yet, and not worth a warning. `path`: the engine's version route (vLLM's is
    `/weight_info`)."""
    versions = []
    for url in urls:
        try:
            async with session.get(url.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                version = str((await r.json())["weight_version"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            _WARN.warning(f"{url} {type(exc).__name__}", "version of %s unknown: %s", url, exc)
            continue
        if version.lstrip("-").isdigit():
            versions.append(int(version))
    return min(versions) if versions else None


async def eval_rounds(cfg: Config, suites: list[EvalSuite], engines: list[str], tokenizer: object, out: Path,
                      stop: asyncio.Event, once: bool = False, poll_s: float = 2.0) -> int:
    """Run rounds until `stop` (or one round with `once`); returns the number of rounds written."""
    every = cfg.data.eval_every
    if every == 0 and not once:
        log.warning("data.eval_every is 0: no rounds are scheduled (use --once for one round)")
    due = 0
    rounds = 0
    log_out = MetricsLog(out, cfg.log, out.parent, cfg.run.name, writer_name="eval")
    async with aiohttp.ClientSession() as session, engine_client(
            cfg.engine.kind, engines, admin_token=cfg.engine.admin_token, lora=cfg.train.lora is not None) as client:
        while not stop.is_set():
            version = await engine_version(session, engines, client.VERSION)
            if version is not None and (once or (every > 0 and version >= due)):
                job = asyncio.ensure_future(run_suites(suites, client, tokenizer))
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({job, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not job.done():  # stopped mid-round: the round is cancelled, nothing written
                    job.cancel()
                    await asyncio.gather(job, return_exceptions=True)
                    break
                results = job.result()
                line: dict[str, float | int] = {"version": version, "time": time.time()}
                for r in results.values():
                    line.update(r.flat())
                log_out.write(line, step=version)
                rounds += 1
                if once:
                    break
                due = next_due(version, every)
            # Polling is the protocol here: engines announce versions to whoever generates, and
            # between rounds this worker does not.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
        await close_shared_remote_rewards()
        await close_shared_server()  # the agent endpoint, when an agent env started one
    log_out.close()
    return rounds


async def main_async(config: str, engines: list[str], out: str, once: bool, poll_s: float) -> int:
    from transformers import AutoTokenizer

    cfg = load_config(config)
    suites = suites_from_config(cfg)
    if not suites:
        print("error: data.eval lists no suites", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.path)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY", flush=True)
    rounds = await eval_rounds(cfg, suites, engines, tokenizer, Path(out), stop, once=once, poll_s=poll_s)
    print(f"DONE rounds={rounds}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime_async.evaluation.worker")
    parser.add_argument("config")
    parser.add_argument("--engine", action="append", required=True, help="URL of an engine (repeat)")
    parser.add_argument("--out", required=True, help="JSON-lines file the rounds are appended to")
    parser.add_argument("--once", action="store_true", help="one round at the current version, then exit")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between version checks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(main_async(args.config, args.engine, args.out, args.once, args.poll_s)))


if __name__ == "__main__":
    main()
