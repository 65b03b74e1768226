"""Placement groups per role, and which GPUs each part's process may use.

One placement group per role reserves what `launch.ray` asks for: a bundle per trainer rank, per
engine, per rollout worker, one for the buffer (and the router, the evaluation worker and the
distillation teacher when there are any). Layouts:

- disaggregated: trainer ranks and engines have bundles (and GPUs) of their own;
- colocated: engines have no group of their own; engine i runs in the trainer's bundles
  i*g .. (i+1)*g - 1 (g = GPUs per engine), on the same GPUs, with its CPUs added to bundle i*g.

Actors reserve only CPUs; the GPUs a part uses are named explicitly (CUDA_VISIBLE_DEVICES of its
process), learned once per bundle from a probe task that holds the bundle's GPUs. That is what
lets two processes share one GPU in the colocated layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_async.config import Config, ConfigError

ROLES = ("buffer", "engine", "router", "eval", "trainer", "rollout", "teacher")


@dataclass
class Slot:
    """Where one part's process runs: a bundle of a placement group, and the GPUs it may use."""

    group: Any
    """The Ray placement group."""
    bundle: int
    cpus: float
    gpus: list[str] = field(default_factory=list)
    """Physical GPU ids on the bundle's node (CUDA_VISIBLE_DEVICES of the process); empty: none."""
    node: str = ""


@dataclass
class Placement:
    groups: dict[str, Any]
    """role -> placement group (colocated engines share the trainer's)."""
    slots: dict[str, list[Slot]]
    """role -> one slot per process of that role."""

    def slot(self, role: str, index: int) -> Slot:
        return self.slots[role][index]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self.groups.values()}.values():
            remove_placement_group(group)


def counts(cfg: Config, with_trainer: bool = True) -> dict[str, int]:
    """How many processes of each role the run has (engines: none when attached by URL)."""
    return {
        "buffer": 1,
        "engine": 0 if cfg.engine.urls else cfg.engine.num_engines,
        "router": 1 if cfg.engine.router.enabled else 0,
        "eval": 1 if cfg.data.eval and cfg.data.eval_every > 0 else 0,
        "trainer": cfg.train.world_size if with_trainer else 0,
        "rollout": cfg.rollout.num_workers,
        "teacher": int(cfg.train.distilling and not cfg.train.distill.urls),
    }


def bundles(cfg: Config, with_trainer: bool = True) -> dict[str, list[dict[str, float]]]:
    """role -> the bundles of its placement group (colocated: engines inside the trainer's)."""
    r = cfg.launch.ray
    n = counts(cfg, with_trainer)
    out: dict[str, list[dict[str, float]]] = {}
    for role in ROLES:
        res = getattr(r, role)
        bundle = {"CPU": res.cpus, **({"GPU": float(res.gpus)} if res.gpus else {})}
        out[role] = [dict(bundle) for _ in range(n[role])]
    if r.layout == "colocated" and n["engine"]:
        g = r.engine.gpus
        if n["trainer"] == 0 or r.trainer.gpus != 1 or g < 1:
            raise ConfigError("launch.ray.layout=colocated: trainer ranks take one GPU each "
                              "(launch.ray.trainer.gpus=1) and engines at least one (launch.ray.engine.gpus)")
        if n["engine"] * g > n["trainer"]:
            raise ConfigError(f"launch.ray.layout=colocated: {n['engine']} engines of {g} GPUs need "
                              f"{n['engine'] * g} GPUs, the trainer has {n['trainer']} (train.world_size)")
        for i in range(n["engine"]):
            out["trainer"][i * g]["CPU"] += r.engine.cpus
        out["engine"] = []
    return out


def create(cfg: Config, name: str, timeout: float, with_trainer: bool = True) -> Placement:
    """Reserve every role's bundles (bounded wait) and learn their GPUs; raises naming what is missing."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    r = cfg.launch.ray
    wanted = bundles(cfg, with_trainer)
    groups: dict[str, Any] = {}
    for role, role_bundles in wanted.items():
        if role_bundles:
            strategy = r.strategy
            if role == "trainer" and strategy == "PACK" and len(role_bundles) > 1:
                strategy = "STRICT_PACK"  # ranks on one node when they fit: NVLink, not the network
            groups[role] = placement_group(role_bundles, strategy=strategy, name=f"{name}-{role}")
    try:
        ray.get([g.ready() for g in groups.values()], timeout=timeout)
    except GetTimeoutError:
        for g in groups.values():
            ray.util.remove_placement_group(g)
        raise RuntimeError(f"Ray could not place {wanted} within {timeout:.0f} s (launch.ready_timeout_s); "
                           f"the cluster has {ray.available_resources()} free: lower launch.ray.*.cpus/gpus "
                           "or add nodes") from None
    slots: dict[str, list[Slot]] = {}
    for role, group in groups.items():
        # an actor asks for its role's CPUs, not its bundle's (a colocated engine's are in the bundle too)
        slots[role] = [Slot(group, i, getattr(r, role).cpus, *_probe(group, i, int(b.get("GPU", 0))))
                       for i, b in enumerate(wanted[role])]
    if r.layout == "colocated" and counts(cfg, with_trainer)["engine"]:
        g = r.engine.gpus
        trainer = slots["trainer"]
        slots["engine"] = []
        for i in range(counts(cfg, with_trainer)["engine"]):
            span = trainer[i * g:(i + 1) * g]
            if len({s.node for s in span}) != 1:
                raise RuntimeError(f"engine {i} would span nodes {[s.node for s in span]}: colocated engines need "
                                   "their GPUs on one node (launch.ray.strategy=STRICT_PACK, or fewer GPUs per engine)")
            slots["engine"].append(Slot(span[0].group, span[0].bundle, r.engine.cpus,
                                        [gpu for s in span for gpu in s.gpus], span[0].node))
        groups["engine"] = groups["trainer"]
    return Placement(groups, slots)


def _probe(group: Any, bundle: int, gpus: int) -> tuple[list[str], str]:
    """(GPU ids, node IP) of a bundle, from a task that holds its GPUs for a moment."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=gpus)
    def where() -> tuple[list[str], str]:
        context = ray.get_runtime_context()
        return [str(i) for i in context.get_accelerator_ids().get("GPU", [])], ray.util.get_node_ip_address()

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    return ray.get(where.options(scheduling_strategy=strategy).remote())
