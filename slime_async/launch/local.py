"""Local mode: every part as a process on this machine, wired by the config, supervised.

Order of start: the buffer server (its endpoint), the engines (their URLs), the trainer, the
rollout workers. A part that dies is reported with the tail of its log and restarted at the same
address (so the others reconnect) up to `launch.max_restarts` times; then the run stops. Shutdown
goes the other way: rollout workers first (they flush what they finished to the buffer), the
trainer, the buffer (its WAL is on disk), the engines. Nothing is left running.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from slime_async.config import Config
from slime_async.config.model_dir import resolve_model_path
from slime_async.launch.process import ChildProcess, start_engine, start_process


def engine_args(cfg: Config, i: int) -> list[str]:
    """`slime-async serve` options of engine i, as the config describes the engines."""
    args = ["--device", cfg.model.device, "--dtype", cfg.model.dtype, "--max-batch-size",
            str(cfg.engine.max_batch_size), "--seed", str(cfg.run.seed + i), "--host", cfg.engine.host]
    if cfg.engine.admin_token:
        args += ["--admin-token", cfg.engine.admin_token]
    return args


class PartFailed(RuntimeError):
    """A part died more often than `launch.max_restarts` allows; the message has its log's tail."""


@dataclass
class Part:
    """One supervised role and how to (re)start it."""

    name: str
    start: Callable[[], ChildProcess]
    child: ChildProcess | None = None
    restarts: int = 0
    finished: bool = False
    """Exited with code 0 on its own (the trainer when its steps are done)."""


@dataclass
class LocalLauncher:
    cfg: Config
    config_path: Path
    """The resolved config file that child processes read."""
    run_dir: Path
    with_trainer: bool = True
    parts: list[Part] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    """What happened to the parts (deaths, restarts), for the run summary."""
    buffer_endpoint: str = ""
    engine_urls: list[str] = field(default_factory=list)

    def start(self, on_event: Callable[[str], None] | None = None) -> None:
        self._on_event = on_event or (lambda message: None)
        model_dir = resolve_model_path(self.cfg.model.path)
        logs = self.run_dir / "logs"
        timeout = self.cfg.launch.ready_timeout_s
        try:
            buffer = Part("buffer", lambda: self._start_buffer(logs, timeout))
            self._launch(buffer)
            for i in range(self.cfg.engine.num_engines):
                engine = Part(f"engine-{i}", self._engine_starter(model_dir, i, logs, timeout))
                self._launch(engine)
                self.engine_urls.append(engine.child.url)  # type: ignore[union-attr]
            if self.cfg.data.eval and self.cfg.data.eval_every > 0:
                # evaluation beside training, in its own process with its own client (never in the
                # rollout's way); started before the trainer so that its baseline round sees version 0
                self._launch(Part("eval", lambda: start_process(
                    "eval", [sys.executable, "-m", "slime_async.data.eval_worker", str(self.config_path),
                             *self._engine_args(), "--out", str(self.run_dir / "eval.jsonl")],
                    r"^READY", timeout, logs / "eval.log")))
            if self.with_trainer:
                self._launch(Part("trainer", lambda: start_process(
                    "trainer", [sys.executable, "-m", "slime_async.train.worker", str(self.config_path),
                                "--buffer", self.buffer_endpoint, *self._engine_args()],
                    r"^READY", timeout, logs / "trainer.log")))
            workers = self.cfg.rollout.num_workers
            for i in range(workers):
                self._launch(Part(f"rollout-{i}", self._worker_starter(i, workers, logs, timeout)))
        except BaseException:
            self.shutdown()
            raise

    def _launch(self, part: Part) -> None:
        part.child = part.start()
        self.parts.append(part)

    def _start_buffer(self, logs: Path, timeout: float) -> ChildProcess:
        from slime_async.buffer import ServerSettings

        settings = ServerSettings.from_config(self.cfg)
        if self.buffer_endpoint:  # a restart binds where the senders and the trainer already point
            settings.buffer = msgspec.structs.replace(settings.buffer, endpoint=self.buffer_endpoint)
        child = start_process("buffer", [sys.executable, "-m", "slime_async.buffer",
                                         msgspec.json.encode(settings).decode()],
                              r"^READY (\S+)", timeout, logs / "buffer.log")
        self.buffer_endpoint = child.ready
        return child

    def _engine_starter(self, model_dir: Path, i: int, logs: Path, timeout: float) -> Callable[[], ChildProcess]:
        c = self.cfg
        args = engine_args(c, i)
        port = [c.engine.port + i if c.engine.port else 0]

        def start() -> ChildProcess:
            child = start_engine(model_dir, *args, port=port[0], timeout=timeout, log_path=logs / f"engine-{i}.log",
                                 name=f"engine-{i}")
            port[0] = int(child.url.rsplit(":", 1)[1])  # restarts come back on the same port
            return child

        return start

    def _worker_starter(self, i: int, workers: int, logs: Path, timeout: float) -> Callable[[], ChildProcess]:
        return lambda: start_process(
            f"rollout-{i}", [sys.executable, "-m", "slime_async.rollout.worker", str(self.config_path),
                             "--buffer", self.buffer_endpoint, *self._engine_args(), "--worker", str(i),
                             "--num-workers", str(workers), "--data-state",
                             str(self.run_dir / f"data-state-{i}.json")],
            r"^READY", timeout, logs / f"rollout-{i}.log")

    def _engine_args(self) -> list[str]:
        return [arg for url in self.engine_urls for arg in ("--engine", url)]

    def check(self) -> None:
        """Restart parts that died (per policy); raise PartFailed when one is out of restarts."""
        for part in self.parts:
            child = part.child
            if child is None or child.alive() or part.finished:
                continue
            code = child.proc.returncode
            if code == 0 and part.name == "trainer":
                part.finished = True
                continue
            message = f"{part.name} exited with code {code}; last lines of {child.log_path}:\n{child.tail()}"
            self.events.append(f"{part.name} died (exit code {code})")
            self._on_event(message)
            if part.restarts >= self.cfg.launch.max_restarts:
                raise PartFailed(message + f"\n{part.name} was restarted {part.restarts} times already: stopping")
            part.restarts += 1
            part.child = part.start()
            self.events.append(f"{part.name} restarted ({part.restarts}/{self.cfg.launch.max_restarts})")
            self._on_event(self.events[-1])

    def supervise(self, done: Callable[[], bool], interval: float = 1.0) -> None:
        """Check the parts every `interval` seconds until `done()` (or the trainer finished)."""
        while not done() and not any(p.finished for p in self.parts):
            self.check()
            time.sleep(interval)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def shutdown(self) -> None:
        """Stop every part, rollout workers first and engines last; nothing is left running."""
        order = {"rollout": 0, "eval": 0, "trainer": 1, "buffer": 2, "engine": 3}
        for part in sorted(self.parts, key=lambda p: order.get(p.name.split("-")[0], 9)):
            if part.child is not None:
                part.child.stop()
