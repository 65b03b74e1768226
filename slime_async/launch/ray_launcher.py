"""Cluster mode: the local launcher's parts, each owned by a Ray actor in its role's placement group.

`RayLauncher` is `LocalLauncher` with three things replaced:

- where a process starts (`spawn`): in a new `PartActor` placed in the part's bundle; the actor fills
  in its node's address and a free port there, and hands back the endpoint or URL the part reports.
  Endpoints and URLs reach the other parts through the driver's arguments to their actors: Ray is the
  only discovery.
- secrets: the buffer binds to the node's address (`launch.ray.host` or the IP Ray knows), always with
  CURVE; the keys are made per run on the driver and handed to each actor that needs them as Ray
  arguments, written into the actor's private directory; engines get an admin token the same way
  (a generated one when `engine.admin_token` is not set). Nothing secret is written to the run directory.
- trainer ranks: `train.world_size` actors start together and meet through torch.distributed
  (`tcp://` rendezvous at rank 0's node); one dead rank restarts them all (from the checkpoint).

Supervision, restarts, the engine replacement protocol and shutdown are the local launcher's.
"""

from __future__ import annotations

import os
import secrets
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slime_async.config import Config, ConfigError, to_yaml
from slime_async.config.model_dir import resolve_model_path
from slime_async.launch.local import HOST, Child, LocalLauncher, Part
from slime_async.launch.placement import Placement, create
from slime_async.launch.ray_actor import SECRETS, PartActor, RayChild


@dataclass
class RayLauncher(LocalLauncher):
    address: str | None = None
    """The Ray cluster (`--ray ADDRESS`); None: `launch.ray.address`, else Ray's own discovery
    (RAY_ADDRESS, a cluster started on this node) or a new local instance."""
    placement: Placement | None = None
    actors: dict[str, Any] = field(default_factory=dict)
    """part name -> its current actor."""
    actor_names: dict[str, str] = field(default_factory=dict)
    client_curve_dir: str | None = None
    """The driver's copy of the CURVE keys (its own buffer client)."""
    distributed = True

    def start(self, on_event: Any = None) -> None:
        import ray

        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            r = self.cfg.launch.ray
            ray.init(address=self.address or r.address, namespace=r.namespace, log_to_driver=False)
        try:
            self.cfg = self._part_config(self.cfg)
            self._files = self._secret_files()
            self.placement = create(self.cfg, f"slime_async-{self.cfg.run.name}", self.cfg.launch.ready_timeout_s,
                                    self.with_trainer)
            super().start(on_event)
        except BaseException:
            self.shutdown()
            raise

    # --- what the parts get ---------------------------------------------------------------------

    def _part_config(self, cfg: Config) -> Config:
        """The config every part reads: addresses and key paths as placeholders that each actor fills
        in, absolute paths, the admin token, and the colocated layout's memory release decided."""
        if cfg.train.world_size > 1 and cfg.train.backend == "torch":
            raise ConfigError(f"train.world_size={cfg.train.world_size}: the torch backend trains on one rank; "
                              "use train.backend=megatron for more")
        r = cfg.launch.ray
        host = r.host or HOST
        run = Path(cfg.run.dir).resolve()
        release = cfg.sync.release_memory
        if release is None:
            release = r.layout == "colocated"
        if release and cfg.train.lora is not None:
            raise ConfigError("train.lora: the colocated layout releases engine memory between steps "
                              "(sync.release_memory), and a LoRA run pushes only the adapted layers back; set "
                              "sync.release_memory: false")
        self.run_dir = run / cfg.run.name
        self._user_curve_dir = cfg.buffer.curve_dir
        endpoint = cfg.buffer.endpoint.replace("127.0.0.1", host).replace("localhost", host)
        model = cfg.model.path
        if not Path(model).is_absolute():
            model = str(resolve_model_path(model))  # `tiny` and relative paths: this node's (shared storage)
        distill = cfg.train.distill
        if distill.model is not None and not Path(distill.model).is_absolute():  # the teacher's likewise
            distill = msgspec.structs.replace(distill, model=str(resolve_model_path(distill.model)))
        token = cfg.engine.admin_token or (None if cfg.engine.urls else secrets.token_hex(16))
        return msgspec.structs.replace(
            cfg,
            run=msgspec.structs.replace(cfg.run, dir=str(run)),
            model=msgspec.structs.replace(cfg.model, path=model),
            train=msgspec.structs.replace(cfg.train, distill=distill),
            engine=msgspec.structs.replace(cfg.engine, host=host, admin_token=token),
            buffer=msgspec.structs.replace(cfg.buffer, endpoint=endpoint, curve_dir=f"{SECRETS}/curve"),
            # the trainer's NCCL rendezvous for weight broadcasts: its own node (filled in by its actor)
            sync=msgspec.structs.replace(cfg.sync, release_memory=release, nccl_master_address=(
                host if cfg.sync.nccl_master_address == "127.0.0.1" else cfg.sync.nccl_master_address)),
        )

    def _secret_files(self) -> dict[str, bytes]:
        """The CURVE keys (the user's `buffer.curve_dir`, or new ones) as files for the actors."""
        from slime_async.transport.security import generate_keys

        source = Path(self._user_curve_dir) if self._user_curve_dir else None
        if source is None:
            self._keys_dir = tempfile.TemporaryDirectory(prefix="slime_async-keys-")
            source = generate_keys(Path(self._keys_dir.name) / "curve").dir
        self.client_curve_dir = str(source)
        return {f"curve/{p.relative_to(source)}": p.read_bytes() for p in source.rglob("*") if p.is_file()}

    # --- where processes start ------------------------------------------------------------------

    def _new_actor(self, name: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        old = self.actors.pop(name, None)
        if old is not None:
            ray.kill(old)  # its process dies with it
        role, _, index = name.partition("-")
        assert self.placement is not None
        slot = self.placement.slot(role, int(index or 0))
        self.actor_names[name] = f"{self.cfg.run.name}.{name}.{os.urandom(3).hex()}"  # unique across restarts
        actor = ray.remote(PartActor).options(
            name=self.actor_names[name], num_cpus=slot.cpus, num_gpus=0,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, slot.bundle),
        ).remote(name, os.getcwd())
        self.actors[name] = actor
        return actor

    def _node(self, name: str, actor: Any) -> tuple[str, int]:
        """The actor's address and a free port there, once Ray has started it (bounded)."""
        import ray
        from ray.exceptions import GetTimeoutError

        timeout = self.cfg.launch.ready_timeout_s
        try:
            return ray.get(actor.node.remote(self.cfg.launch.ray.host), timeout=timeout)
        except GetTimeoutError:
            raise RuntimeError(f"{name}: Ray did not start its actor within {timeout:.0f} s (launch.ready_timeout_s); "
                               f"free now: {ray.available_resources()}") from None

    def _start_args(self, name: str, host: str, port: int, wait: bool = True,
                    health_url: str | None = None, own_group: bool = False) -> dict[str, Any]:
        role, _, index = name.partition("-")
        assert self.placement is not None
        slot = self.placement.slot(role, int(index or 0))
        env = {"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)} if slot.gpus else {}
        files = {**self._files, "config.yaml": to_yaml(self.cfg).encode()}
        return {"host": host, "port": port, "files": files, "env": env, "health_url": health_url,
                "log_path": str(self.run_dir / "logs" / f"{name}.log"), "timeout": self.cfg.launch.ready_timeout_s,
                "wait": wait, "own_group": own_group}

    def threads_env(self, compute: bool) -> dict[str, str]:
        """Nothing: Ray sets each actor's OMP_NUM_THREADS from its `cpus`, which its process inherits."""
        return {}

    def spawn(self, name: str, argv: list[str], ready: str | None, *, health_url: str | None = None,
              port: int = 0, orphan_signal: int = signal.SIGKILL, own_group: bool = False,
              env: dict[str, str] | None = None) -> Child:
        """`orphan_signal` is not used: every part here gets SIGKILL when its actor dies (`ray_actor`)."""
        import ray

        actor = self._new_actor(name)
        host, free = self._node(name, actor)
        args = self._start_args(name, host, port or free, health_url=health_url, own_group=own_group)
        args["env"] = {**args["env"], **(env or {})}  # Ray arguments, not the command line: the admin token
        start = actor.start.remote(argv, ready, **args)
        try:
            reported = ray.get(start, timeout=self.cfg.launch.ready_timeout_s + 60)
        except Exception as exc:
            raise RuntimeError(f"{name} did not start: {exc}") from None
        return RayChild(name, actor, reported, self.run_dir / "logs" / f"{name}.log")

    def _start_trainer(self) -> None:
        """`train.world_size` ranks, started together (rank 0 waits for the others in its rendezvous)."""
        n = self.cfg.train.world_size
        names = ["trainer"] if n == 1 else [f"trainer-{r}" for r in range(n)]
        children: dict[str, Child] = {}

        def start_rank(rank: int) -> Child:
            if rank == 0:  # every rank's start begins with rank 0's (a group restart goes in order)
                children.clear()
                children.update(self._start_ranks(names))
            return children[names[rank]]

        for rank, name in enumerate(names):
            self._launch(Part(name, lambda restarts, rank=rank: start_rank(rank), group="trainer"))

    def _start_ranks(self, names: list[str]) -> dict[str, Child]:
        import ray

        actors = [self._new_actor(name) for name in names]
        master_host, master_port = self._node(names[0], actors[0])
        init = f"tcp://{master_host}:{master_port}"
        for rank, (name, actor) in enumerate(zip(names, actors, strict=True)):
            host, port = self._node(name, actor)
            argv = [*self._trainer_argv(), "--rank", str(rank), "--world-size", str(len(names)), "--dist-init", init]
            ray.get(actor.start.remote(argv, r"^READY", **self._start_args(name, host, port, wait=False)))
        timeout = self.cfg.launch.ready_timeout_s
        try:
            ray.get([a.wait_ready.remote(timeout) for a in actors], timeout=timeout + 60)
        except Exception as exc:
            raise RuntimeError(f"trainer ranks did not start: {exc}") from None
        return {name: RayChild(name, actor, "", self.run_dir / "logs" / f"{name}.log")
                for name, actor in zip(names, actors, strict=True)}

    def describe(self) -> dict[str, str]:
        """part -> `actor NAME on NODE (bundle B of its role's placement group, GPUs ...)`."""
        out = {}
        assert self.placement is not None
        for name in self.actors:
            role, _, index = name.partition("-")
            slot = self.placement.slot(role, int(index or 0))
            gpus = f", GPUs {','.join(slot.gpus)}" if slot.gpus else ""
            out[name] = f"actor {self.actor_names[name]} on {slot.node} (bundle {slot.bundle}{gpus})"
        return out

    # --- the end --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        import ray

        try:
            super().shutdown()
            for actor in self.actors.values():
                ray.kill(actor)
            self.actors.clear()
            if self.placement is not None:
                self.placement.remove()
                self.placement = None
        finally:
            keys = getattr(self, "_keys_dir", None)
            if keys is not None:
                keys.cleanup()
            if getattr(self, "_started_ray", False) and ray.is_initialized():
                ray.shutdown()

