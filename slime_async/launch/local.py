"""Local mode: every part as a process on this machine, wired by the config, supervised.

Order of start: the buffer server (its endpoint), the engines (their URLs: embedded engines,
SGLang servers, or the attached `engine.urls`), sglang-router in front of them when configured,
the evaluation worker, the trainer, the rollout workers. A part that dies is reported with the tail
of its log and restarted at the same address (so the others reconnect) up to `launch.max_restarts`
times; then the run stops. A restarted engine starts with the weight version `pending`, which
clients refuse, until the trainer's next push (or reconcile) brings it to the current version.
Shutdown goes the other way: rollout workers first (they flush what they finished to the buffer),
the trainer, the buffer (its WAL is on disk), the router, the engines. Nothing is left running.

`RayLauncher` (`launch.ray_launcher`) is this class with `spawn` (where a process runs) and the
addresses replaced: each part's process then belongs to a Ray actor in its role's placement group.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from slime_async.config import Config, ConfigError
from slime_async.config.model_dir import resolve_model_path
from slime_async.config.schema import ADMIN_TOKEN_ENV
from slime_async.engine.protocol import PENDING_VERSION  # what a replacement engine reports until trained weights
from slime_async.launch.health import wait_healthy
from slime_async.launch.process import start_process
from slime_async.launch.sglang_command import preflight, router_argv, sglang_argv
from slime_async.launch.vllm_command import load_vllm_adapter, set_vllm_version, vllm_argv
from slime_async.rundir.run_log import append_event
from slime_async.types.oom import OUT_OF_MEMORY_EXIT

HOST, PORT, CONFIG = "@HOST@", "@PORT@", "@CONFIG@"
"""Placeholders in a part's command line, filled in where the process starts: the address it binds
to and announces, a port (the requested one, or a free one there), the config file it reads."""
SECOND_PORT = "@SECOND_PORT@"
"""A second port a part needs (the router's metrics), chosen free on its host each time it starts."""
PORT_TRIES = 3
"""Ports a part is started on before its start fails: a port found free can be taken before the part binds it."""

ENGINE_READY = r"serving on (http://\S+)"


def engine_args(cfg: Config, i: int) -> list[str]:
    """`slime-async serve` options of engine i, as the config describes the engines."""
    args = ["--device", cfg.model.device, "--dtype", cfg.model.dtype, "--max-batch-size",
            str(cfg.engine.max_batch_size), "--seed", str(cfg.run.seed + i), "--host", cfg.engine.host]
    return args  # the admin token goes by the environment (`engine_env`), never on the command line


def compute_threads(cfg: Config, with_trainer: bool) -> int:
    """This machine's cores divided among the processes that compute on them (at least 1 each)."""
    engines = cfg.engine.num_engines if cfg.engine.kind == "embedded" and not cfg.engine.urls else 0
    engines += int(cfg.train.distilling and not cfg.train.distill.urls)  # the teacher's embedded engine
    return max(1, len(os.sched_getaffinity(0)) // max(1, engines + int(with_trainer)))


def engine_env(cfg: Config) -> dict[str, str]:
    """The environment an embedded engine gets: its admin token, where the config sets one."""
    return {ADMIN_TOKEN_ENV: cfg.engine.admin_token} if cfg.engine.admin_token else {}


class PartFailed(RuntimeError):
    """A part died more often than `launch.max_restarts` allows; the message has its log's tail."""


class Child(Protocol):
    """A running part's process, wherever it runs (`process.ChildProcess`, `ray_actor.RayChild`)."""

    ready: str
    """What its ready line said (an endpoint, a URL), or its URL when readiness was a health check."""
    log_path: Path | None

    @property
    def url(self) -> str: ...

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...

    def exit_reason(self) -> str: ...

    def tail(self, n: int = 20) -> str: ...

    def stop(self, timeout: float = 20.0) -> int | None: ...


@dataclass
class Part:
    """One supervised role and how to (re)start it."""

    name: str
    start: Callable[[int], Child]
    """Starts the part's process; the argument is how many times it was restarted already."""
    child: Child | None = None
    restarts: int = 0
    finished: bool = False
    """Exited with code 0 on its own (the trainer when its steps are done)."""
    group: str | None = None
    """Parts that live and die together (the ranks of one torch.distributed trainer)."""


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
    """Where the trainer pushes weights: every engine."""
    rollout_urls: list[str] = field(default_factory=list)
    """Where rollout workers send requests: the router when there is one, else every engine."""
    teacher_urls: list[str] = field(default_factory=list)
    """On-policy distillation's teacher servers (`train.distill`): started here, or attached."""

    _on_event: Callable[[str], None] = field(default_factory=lambda: _quiet, init=False, repr=False)
    """Shows an event on the console; `start` sets it."""

    def start(self, on_event: Callable[[str], None] | None = None) -> None:
        self._on_event = on_event or _quiet
        if self.cfg.train.world_size > 1 and self.with_trainer and not self.distributed:
            raise ConfigError(f"train.world_size={self.cfg.train.world_size}: local mode runs one trainer rank; "
                              "use `slime-async train CONFIG --ray` for more")
        self.model_dir = resolve_model_path(self.cfg.model.path)
        try:
            self._launch(Part("buffer", self._start_buffer))
            self._start_engines()
            self.rollout_urls = list(self.engine_urls)
            if self.cfg.engine.router.enabled:
                router = Part("router", self._start_router)
                self._launch(router)
                self.rollout_urls = [router.child.url]  # type: ignore[union-attr]
            self._start_teacher()
            if self.cfg.data.eval and self.cfg.data.eval_every > 0:
                # evaluation beside training, in its own process with its own client (never in the
                # rollout's way); started before the trainer so that its baseline round sees version 0
                self._launch(Part("eval", lambda restarts: self.spawn(
                    "eval", [sys.executable, "-m", "slime_async.evaluation.worker", CONFIG,
                             *self._url_args(self.rollout_urls), "--out", str(self.run_dir / "eval.jsonl")],
                    r"^READY")))
            if self.with_trainer:
                self._start_trainer()
            workers = self.cfg.rollout.num_workers
            for i in range(workers):
                self._launch(Part(f"rollout-{i}", self._worker_starter(i, workers)))
        except BaseException:
            self.shutdown()
            raise

    # --- where and how a process starts (RayLauncher overrides these) ---------------------------

    distributed = False
    """Whether this launcher can start trainer ranks that join one torch.distributed group."""

    def spawn(self, name: str, argv: list[str], ready: str | None, *, health_url: str | None = None,
              port: int = 0, orphan_signal: int = signal.SIGTERM, own_group: bool = False,
              env: dict[str, str] | None = None) -> Child:
        """Start one part's process here and wait (bounded) until it is ready: its ready line matches
        `ready`, or `health_url` answers 200. `argv` and `health_url` may hold the placeholders.
        The process gets `orphan_signal` if this launcher dies without shutting it down; with
        `own_group` it leads a process group that goes with it (a server with processes of its own)."""
        host = self.cfg.engine.host
        for attempt in range(1, PORT_TRIES + 1):
            chosen = port or free_port(host)
            try:
                return self._spawn_on(name, argv, ready, host, chosen, health_url=health_url,
                                      orphan_signal=orphan_signal, own_group=own_group, env=env)
            except RuntimeError as exc:
                # the port was free when asked for, and taken before the part bound it: choose another
                if port or attempt == PORT_TRIES or "address already in use" not in str(exc).lower():
                    raise
                self._event(f"{name}: port {chosen} was taken before it bound it; trying another")
        raise AssertionError("unreachable")

    def _spawn_on(self, name: str, argv: list[str], ready: str | None, host: str, port: int, *,
                  health_url: str | None, orphan_signal: int, own_group: bool, env: dict[str, str] | None) -> Child:
        argv = [fill(a, host, port, str(self.config_path)) for a in argv]
        preflight(argv)
        timeout = self.cfg.launch.ready_timeout_s
        child = start_process(name, argv, ready, timeout, self.run_dir / "logs" / f"{name}.log",
                              parent_death_signal=orphan_signal, own_group=own_group, env=env)
        if health_url is not None:
            url = fill(health_url, host, port, "")
            try:
                wait_healthy(url, timeout, alive=child.alive)
            except (TimeoutError, RuntimeError) as exc:
                child.stop()
                raise RuntimeError(f"{name}: {exc}; last lines of its log:\n{child.tail()}") from None
            child.ready = url
        return child

    # --- the parts ------------------------------------------------------------------------------

    def _launch(self, part: Part) -> None:
        part.child = part.start(0)
        self.parts.append(part)

    def _buffer_settings(self) -> str:
        from slime_async.buffer import ServerSettings

        settings = ServerSettings.from_config(self.cfg)
        if self.buffer_endpoint:  # a restart binds where the senders and the trainer already point
            settings.buffer = msgspec.structs.replace(settings.buffer, endpoint=self.buffer_endpoint)
        return msgspec.json.encode(settings).decode()

    def _start_buffer(self, restarts: int) -> Child:
        child = self.spawn("buffer", [sys.executable, "-m", "slime_async.buffer", self._buffer_settings()],
                           r"^READY (\S+)")
        self.buffer_endpoint = child.ready
        return child

    def _start_engines(self) -> None:
        if self.cfg.engine.urls:  # attached: someone else runs (and restarts) them
            self.engine_urls = [u.rstrip("/") for u in self.cfg.engine.urls]
            return
        for i in range(self.cfg.engine.num_engines):
            engine = Part(f"engine-{i}", self._engine_starter(i))
            self._launch(engine)
            self.engine_urls.append(engine.child.url)  # type: ignore[union-attr]

    def _start_teacher(self) -> None:
        """The teacher of `train.distill`: an embedded engine on its checkpoint, at version 0 for good
        (the trainer never pushes to it), or the servers `train.distill.urls` names."""
        d = self.cfg.train.distill
        if d.model is None:
            return
        if d.urls:
            self.teacher_urls = [u.rstrip("/") for u in d.urls]
            return
        port = [0]

        def start(restarts: int) -> Child:
            args = engine_args(self.cfg, 0)
            args[args.index("--host") + 1] = HOST
            argv = [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(d.model), *args,
                    "--port", PORT, "--weight-version", "0"]
            child = self.spawn("teacher", argv, ENGINE_READY, port=port[0],
                               env={**engine_env(self.cfg), **self.threads_env(compute=True)})
            port[0] = int(child.url.rsplit(":", 1)[1])  # a restart comes back where the workers point
            return child

        teacher = Part("teacher", start)
        self._launch(teacher)
        self.teacher_urls = [teacher.child.url]  # type: ignore[union-attr]

    def _engine_starter(self, i: int) -> Callable[[int], Child]:
        c = self.cfg
        port = [c.engine.port + i if c.engine.port else 0]
        spawn = {"embedded": self._spawn_embedded, "sglang": self._spawn_sglang,
                 "vllm": self._spawn_vllm}[c.engine.kind]

        def start(restarts: int) -> Child:
            child = spawn(i, "0" if restarts == 0 else PENDING_VERSION, port[0])
            port[0] = int(child.url.rsplit(":", 1)[1])  # restarts come back on the same port
            return child

        return start

    # one per `engine.kind` (`config.engine_kinds`): engine i's process, serving `version` at first

    def _spawn_embedded(self, i: int, version: str, port: int) -> Child:
        args = engine_args(self.cfg, i)
        args[args.index("--host") + 1] = HOST  # the address of the node it runs on
        argv = [sys.executable, "-m", "slime_async.cli", "serve", "--model", str(self.model_dir),
                *args, "--port", PORT, "--weight-version", version]
        return self.spawn(f"engine-{i}", argv, ENGINE_READY, port=port,
                          env={**engine_env(self.cfg), **self.threads_env(compute=True)})

    def _spawn_sglang(self, i: int, version: str, port: int) -> Child:
        argv = sglang_argv(self.cfg, model_path=str(self.model_dir), host=HOST, port=PORT, index=i,
                           weight_version=version, release_memory=bool(self.cfg.sync.release_memory))
        return self.spawn(f"engine-{i}", argv, None, health_url=f"http://{HOST}:{PORT}", port=port)

    def _spawn_vllm(self, i: int, version: str, port: int) -> Child:
        argv = vllm_argv(self.cfg, model_path=str(self.model_dir), host=HOST, port=PORT, index=i)
        child = self.spawn(f"engine-{i}", argv, None, health_url=f"http://{HOST}:{PORT}", port=port,
                           own_group=True)  # its engine-core and worker processes go with it
        set_vllm_version(child.url, version)  # vLLM starts at "default"; it has no flag for it
        lora = self.cfg.train.lora
        if lora is not None:  # the adapters the requests ask for: zero (the base model) until the first push
            zero = self.run_dir / "lora-zero"
            if not (zero / "adapter_config.json").is_file():
                from slime_async.train.lora import save_zero_adapters  # torch: only in a LoRA run

                save_zero_adapters(self.model_dir, lora.rank, lora.alpha, lora.target_modules, zero)
            load_vllm_adapter(child.url, zero)
        return child

    def _start_router(self, restarts: int) -> Child:
        port = self.cfg.engine.router.port
        if restarts:  # the rollout workers already point at it: same address
            port = int(self.rollout_urls[0].rsplit(":", 1)[1])
        return self.spawn("router", router_argv(self.cfg, self.engine_urls, HOST, PORT, SECOND_PORT), None,
                          health_url=f"http://{HOST}:{PORT}", port=port)

    def _start_trainer(self) -> None:
        # SIGKILL, not SIGTERM, when the launcher dies: the buffer and engines die with it, so a graceful
        # end would wait out the timeouts of its last requests to them (30 s and more), and a killed
        # trainer loses nothing (checkpoints; the buffer hands unreported batches back on --resume)
        self._launch(Part("trainer", lambda restarts: self.spawn("trainer", self._trainer_argv(), r"^READY",
                                                                 orphan_signal=signal.SIGKILL,
                                                                 env=self.threads_env(compute=True))))

    def _trainer_argv(self) -> list[str]:
        return [sys.executable, "-m", "slime_async.train.worker", CONFIG, "--buffer", self.buffer_endpoint,
                *self._url_args(self.engine_urls)]

    def _worker_starter(self, i: int, workers: int) -> Callable[[int], Child]:
        return lambda restarts: self.spawn(
            f"rollout-{i}", [sys.executable, "-m", "slime_async.rollout.worker", CONFIG,
                             "--buffer", self.buffer_endpoint, *self._url_args(self.rollout_urls), "--worker", str(i),
                             "--num-workers", str(workers), "--data-state",
                             str(self.run_dir / f"data-state-{i}.json"),
                             *[arg for url in self.teacher_urls for arg in ("--teacher", url)]],
            r"^READY", env=self.threads_env(compute=False))

    def threads_env(self, compute: bool) -> dict[str, str]:
        """OMP_NUM_THREADS for a part (`launch.torch_threads`): the cores shared among the processes that
        compute (the trainer, embedded engines), 1 for the others; nothing when the environment sets it."""
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        if not compute:
            return {"OMP_NUM_THREADS": "1"}
        return {"OMP_NUM_THREADS": str(self.cfg.launch.torch_threads or compute_threads(self.cfg, self.with_trainer))}

    @staticmethod
    def _url_args(urls: list[str]) -> list[str]:
        return [arg for url in urls for arg in ("--engine", url)]

    # --- supervision ----------------------------------------------------------------------------

    def check(self) -> None:
        """Restart parts that died (per policy); raise PartFailed when one is out of restarts."""
        for part in self.parts:
            child = part.child
            if child is None or part.finished or child.alive():
                continue
            if child.returncode == 0 and part.name.split("-")[0] == "trainer":
                part.finished = True
                continue
            message = f"{part.name} {child.exit_reason()}; last lines of {child.log_path}:\n{child.tail()}"
            self._event(f"{part.name} died ({child.exit_reason()})", shown=message)
            if child.returncode == OUT_OF_MEMORY_EXIT:  # with the same settings it would again: the run stops
                raise PartFailed(message + f"\n{part.name} ran out of memory: not restarted (the same settings "
                                 "would fail the same way); its last lines say which settings decide its memory")
            if part.restarts >= self.cfg.launch.max_restarts:
                raise PartFailed(message + f"\n{part.name} was restarted {part.restarts} times already: stopping")
            # ranks of one torch.distributed group cannot go on without the dead one: all start again
            group = [p for p in self.parts if p.group is not None and p.group == part.group] or [part]
            for member in group:
                if member is not part and member.child is not None:
                    member.child.stop()
            for member in group:
                member.restarts += 1
                member.child = member.start(member.restarts)
                self._event(f"{member.name} restarted ({member.restarts}/{self.cfg.launch.max_restarts})")

    def _event(self, message: str, shown: str | None = None) -> None:
        """Record what happened to a part: in the summary, in `events.jsonl`, on the console."""
        self.events.append(message)
        append_event(self.run_dir, message)
        self._on_event(shown or message)

    def supervise(self, done: Callable[[], bool], interval: float = 1.0) -> None:
        """Check the parts every `interval` seconds until `done()` (or the trainer finished)."""
        while not done() and not any(p.finished for p in self.parts):
            self.check()
            time.sleep(interval)

    def describe(self) -> dict[str, str]:
        """Where each part runs, for the run summary."""
        return {p.name: f"pid {p.child.proc.pid}" for p in self.parts  # type: ignore[union-attr]
                if p.child is not None and hasattr(p.child, "proc")}

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def stop_rollout(self) -> None:
        """Stop the rollout workers (they flush what they finished to the buffer first)."""
        for part in self.parts:
            if part.name.startswith("rollout") and part.child is not None:
                part.child.stop(timeout=60)

    def shutdown(self) -> None:
        """Stop every part, rollout workers first and engines last; nothing is left running."""
        order = {"rollout": 0, "eval": 0, "trainer": 1, "buffer": 2, "router": 3, "engine": 4, "teacher": 4}
        for part in sorted(self.parts, key=lambda p: order.get(p.name.split("-")[0], 9)):
            if part.child is not None:
                part.child.stop()


def _quiet(message: str) -> None:
    """Shows nothing: events before `LocalLauncher.start` names where they go."""


def fill(text: str, host: str, port: int, config: str) -> str:
    """`text` with the placeholders replaced (`SECOND_PORT` by a port free on `host` now, so that each
    start of a part, a retry or a restart, gets one of its own)."""
    if SECOND_PORT in text:
        text = text.replace(SECOND_PORT, str(free_port(host)))
    return text.replace(HOST, host).replace(PORT, str(port)).replace(CONFIG, config)


def free_port(host: str) -> int:
    """A port that is free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
