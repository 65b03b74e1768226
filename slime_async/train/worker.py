"""The trainer process: batches from the buffer server, steps, weights to the engines, metrics to a file.

`python -m slime_async.train.worker CONFIG_YAML --buffer ENDPOINT --engine URL [--engine URL ...]
[--rank R --world-size N --dist-init tcp://HOST:PORT]` joins the torch.distributed group when given
one (the Ray launcher starts `train.world_size` ranks so), resumes from the run's latest checkpoint
if there is one, tells the buffer its version (handing back batches that a previous trainer received
but did not train by that checkpoint), prints `READY`, and trains until `train.steps`; each step
appends one JSON line to `<run dir>/metrics.jsonl` (mirrored to TensorBoard and wandb per `log:`) and
the ids it trained to `<run dir>/trained_ids.jsonl`, and every `log.sample_every` steps a few of the
batch's trajectories, decoded, to `<run dir>/samples.md`; with `log.trajectories` every trained
trajectory (with its advantage) to `<run dir>/trajectories.sqlite` and the buffer's books to
`<run dir>/buffer.jsonl`, for the dashboard (`slime_async.train.recorder`). Coming back from a
checkpoint, it drops the lines (and rows) of the steps it undid and says so in `<run dir>/events.jsonl`.
SIGTERM/SIGINT end it after the batch in progress (a checkpoint is
written at the end of a complete run).

With `--world-size N > 1` (the megatron backend) rank 0 alone does the above that touches the buffer,
the engines and the run's files; it hands each batch, each weight export and each stop decision to
the other ranks over a gloo control group (`slime_async.train.ranks`), which train on the same
batches in step with it. A SIGTERM to any rank ends them all after the same step; an error on rank
0 ends the others with its message (exit code 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from slime_async.config import Config, load_config
from slime_async.train.distributed import DistInit, close_distributed, init_distributed
from slime_async.train.loop import StepRecord
from slime_async.train.ranks import ControlGroup, RanksAborted, control_timeout
from slime_async.types import Trajectory
from slime_async.types.oom import OUT_OF_MEMORY_EXIT, is_out_of_memory

log = logging.getLogger("slime_async.train.worker")


class BufferSource:
    """The trainer's `BatchSource` over the buffer server's ZeroMQ client."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.received = 0
        self.last: list[Trajectory] = []
        """The latest batch, for the readable samples."""

    def get_batch(self, n: int, timeout: float) -> list[Trajectory] | None:
        try:
            batch = self.client.get_batch(n, timeout)
        except TimeoutError:
            return None
        trajectories = [t for group in batch.groups for t in group.trajectories]
        self.received += len(trajectories)
        self.last = trajectories
        return trajectories

    def set_version(self, version: int) -> None:
        self.client.set_version(version)

    def commit(self, version: int) -> None:
        self.client.set_version(version, committed=version)


def metrics_line(record: StepRecord, counters: dict[str, int], started: float) -> dict[str, Any]:
    return {
        "version": record.version, "applied": record.applied, "trajectories": record.trajectories,
        "loss": record.loss, "grad_norm": record.grad_norm, "max_staleness": record.max_staleness,
        "seconds": record.seconds, "elapsed_s": time.monotonic() - started, "time": time.time(),
        "skipped_steps": record.skipped_steps, "publish_s": getattr(record.publish, "seconds", None),
        "publish_bytes": getattr(record.publish, "bytes", None), **record.times,
        **{k: v for k, v in record.metrics.items() if isinstance(v, int | float)},
        "counters": dict(counters),
    }


async def run_trainer(config_path: str, buffer: str, engines: list[str], dist: DistInit | None = None) -> int:
    cfg = load_config(config_path)
    ranks: ControlGroup | None = None
    if dist is not None:
        if dist.world_size > 1 and cfg.train.backend != "megatron":
            raise ValueError(f"train.world_size={dist.world_size}: the {cfg.train.backend} backend trains on one "
                             "rank; use train.backend=megatron for more")
        # before the backend is built: a backend that splits ranks into parallel groups needs the
        # default group (the megatron backend); the torch backend runs on one rank
        init_distributed(dist)
        if dist.world_size > 1:  # made first on every rank: new_group calls must come in the same order
            ranks = ControlGroup(control_timeout(cfg))
    if ranks is not None and not ranks.leader:
        return await follow(cfg, engines, ranks)
    try:
        return await lead(cfg, buffer, engines, ranks)
    except BaseException as exc:
        if ranks is not None:  # the others wait on rank 0: they end with its error instead of a timeout
            await asyncio.to_thread(ranks.abort, f"{type(exc).__name__}: {exc}")
        if is_out_of_memory(exc):  # the launcher stops the run on this code: a restart would fail the same way
            print(f"error: {out_of_memory_message(cfg, exc)}", file=sys.stderr, flush=True)
            return OUT_OF_MEMORY_EXIT
        raise
    finally:
        if dist is not None:
            close_distributed()


def out_of_memory_message(cfg: Config, exc: BaseException) -> str:
    """What ran out of memory and the settings that decide the trainer's memory, in one line."""
    t = cfg.train
    fixes = [f"lower train.micro_batch_size (now {t.micro_batch_size}) or train.max_seq_len (now {t.max_seq_len})"]
    if t.backend == "megatron" and not t.megatron.recompute_activations:
        fixes.append("set train.megatron.recompute_activations")
    if t.lora is None:
        fixes.append("train adapters alone (train.lora)")
    fixes.append("or leave the trainer more of the device (an engine on the same GPU holds the rest; "
                 "sync.release_memory gives it back while the trainer steps)")
    first = str(exc).splitlines()[0] if str(exc) else ""
    return (f"trainer: out of memory ({t.backend} backend, model {cfg.model.path} in {cfg.model.dtype} on "
            f"{cfg.model.device}): {', '.join(fixes)}; {type(exc).__name__}: {first}")


async def follow(cfg: Config, engines: list[str], ranks: ControlGroup) -> int:
    """A rank other than 0: the same loop and backend calls, on the batches rank 0 hands out."""
    from slime_async.train.build import build_trainer

    try:
        trainer = build_trainer(cfg, None, engines, ranks=ranks)
        trainer.resume()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, trainer.stop)
        print(f"READY version={trainer.version} rank={ranks.rank}", flush=True)
        await trainer.run()
    except RanksAborted as exc:
        log.error("%s", exc)
        print(f"ABORTED rank={ranks.rank}: {exc}", flush=True)
        return 1
    finally:
        close_distributed()
    print(f"DONE version={trainer.version} rank={ranks.rank}", flush=True)
    return 0


async def lead(cfg: Config, buffer: str, engines: list[str], ranks: ControlGroup | None) -> int:
    """Rank 0 (or the only rank): the buffer, the engines, the metrics and samples."""
    from slime_async.buffer import BufferClient
    from slime_async.config.model_dir import load_tokenizer, resolve_model_path
    from slime_async.rundir.run_log import TRAINED_IDS, append_event, roll_back_metrics
    from slime_async.train.build import build_trainer, run_dir
    from slime_async.train.metrics_log import MetricsLog
    from slime_async.train.samples import append_samples

    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
    client = BufferClient(buffer, curve_dir=cfg.buffer.curve_dir)
    source = BufferSource(client)
    trainer = build_trainer(cfg, source, engines, ranks=ranks)
    resumed = trainer.resume()
    # a restarted trainer gets back the batches its predecessor received but did not train by the
    # checkpoint it came back from: the run's data is trained exactly once
    client.set_version(trainer.version, restarted=True)
    out_dir = run_dir(cfg)
    undone = roll_back_metrics(out_dir / "metrics.jsonl", trainer.version)
    roll_back_metrics(out_dir / TRAINED_IDS, trainer.version)
    recorder = None
    if cfg.log.trajectories:  # the dashboard's record: trajectories with advantages, the buffer's books
        from slime_async.train.objective import Objective
        from slime_async.train.recorder import RunRecorder

        try:
            recorder = RunRecorder(out_dir, tokenizer, Objective(cfg.train).advantage, client)
            recorder.roll_back(trainer.version)
        except Exception as exc:  # a view of the run: training goes on without it
            log.warning("trajectory store off: %s: %s", type(exc).__name__, exc)
            recorder = None
    if undone is not None:
        append_event(out_dir, f"trainer went back from version {undone} to its checkpoint at {trainer.version} "
                     f"({undone - trainer.version} steps to train again)", rolled_back_from=undone,
                     rolled_back_to=trainer.version)
    metrics = MetricsLog(out_dir / "metrics.jsonl", cfg.log, out_dir, cfg.run.name)
    started = time.monotonic()

    def on_step(record: StepRecord) -> None:
        metrics.write(metrics_line(record, trainer.counters, started), step=record.version)
        if record.applied:  # the trainer's own record of what each step trained (checked against the buffer's)
            with (out_dir / TRAINED_IDS).open("a") as f:
                f.write(json.dumps({"version": record.version, "ids": [t.id for t in source.last]}) + "\n")
        every = cfg.log.sample_every
        if every and record.version % every == 0 and source.last:
            append_samples(out_dir / "samples.md", source.last, tokenizer, record.version)
        if recorder is not None:
            recorder.on_step(record.version, record.applied, source.last)

    trainer.on_step = on_step
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, trainer.stop)
    print(f"READY version={trainer.version} resumed={resumed}", flush=True)
    await trainer.run()
    print(f"DONE version={trainer.version} counters={dict(trainer.counters)}", flush=True)
    client.close()
    metrics.close()
    if recorder is not None:
        recorder.close()
    if trainer.publisher is not None:
        await trainer.publisher.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime_async.train.worker")
    parser.add_argument("config", type=Path)
    parser.add_argument("--buffer", required=True)
    parser.add_argument("--engine", action="append", default=[])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--dist-init", default=None, help="tcp://HOST:PORT of rank 0's rendezvous")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist = DistInit(args.rank, args.world_size, args.dist_init) if args.dist_init else None
    sys.exit(asyncio.run(run_trainer(str(args.config), args.buffer, args.engine, dist)))


if __name__ == "__main__":
    main()
