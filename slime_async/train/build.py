"""Building the trainer from the config tree: the one call the launcher makes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from slime_async.config.engine_kinds import engine_kind
from slime_async.config.schema import Config
from slime_async.sync.publisher import WeightPublisher
from slime_async.train.backend import OptimizerSettings, TrainerBackend
from slime_async.train.loop import BatchSource, Stateful, Trainer, WeightSink

if TYPE_CHECKING:
    from slime_async.train.ranks import ControlGroup


def build_backend(config: Config, model_path: str | Path | None = None) -> TrainerBackend:
    """The backend named by `train.backend`, loaded from `model.path` (or `model_path`)."""
    from slime_async.config.model_dir import resolve_model_path

    tc = config.train
    path = model_path if model_path is not None else resolve_model_path(config.model.path)
    # an engine that loads adapters itself (vLLM) is sent them instead of merged weights
    adapters = tc.lora is not None and engine_kind(config.engine.kind).lora_adapters
    common = dict(device=config.model.device, dtype=config.model.dtype, optim=OptimizerSettings.from_config(tc),
                  micro_batch_size=tc.micro_batch_size, reference=tc.kl_coef > 0, moe=tc.moe, lora=tc.lora,
                  publish_adapters=adapters)
    if tc.backend == "megatron":
        if tc.lr_warmup_steps:
            raise ValueError("train.lr_warmup_steps: the megatron backend has no learning-rate warm-up yet; use 0")
        try:
            from slime_async.train.megatron.backend import MegatronBackend
        except ImportError as exc:
            raise ValueError(f"train.backend: megatron needs megatron-core (pip install 'slime-async[megatron]'): "
                             f"{exc}") from None
        return MegatronBackend(path, parallel=tc.megatron, **common)  # type: ignore[arg-type]
    from slime_async.train.torch_backend import TorchBackend

    return TorchBackend(path, warmup_steps=tc.lr_warmup_steps, **common)  # type: ignore[arg-type]


def run_dir(config: Config) -> Path:
    return Path(config.run.dir) / config.run.name


def build_publisher(config: Config, engine_urls: list[str]) -> WeightPublisher:
    disk_dir = Path(config.sync.disk_dir) if config.sync.disk_dir else run_dir(config) / "weights"
    tp = (getattr(config.sglang, "tp_size", None) or 1) if config.engine.kind == "sglang" else 1
    return WeightPublisher(engine_urls, config.sync, disk_dir=disk_dir, admin_token=config.engine.admin_token,
                           engine_tp_size=tp, engine_kind=config.engine.kind, lora=config.train.lora,
                           base_model=str(config.model.path), partial_mode=config.rollout.partial_mode)


def build_trainer(
    config: Config,
    source: BatchSource | None,
    engine_urls: list[str],
    *,
    extra_state: dict[str, Stateful] | None = None,
    backend: TrainerBackend | None = None,
    ranks: ControlGroup | None = None,
) -> Trainer:
    """A `Trainer` over `source`, publishing to `engine_urls` (none: no publishing), checkpointing
    under `<run.dir>/<run.name>/checkpoints`. Call `trainer.resume()` then `await trainer.run()`.

    With `ranks` (several trainer ranks) rank 0's `source` and publisher are shared with the others
    through it; on the other ranks `source` is not used (pass None) and nothing is published."""
    from slime_async.train.loop import seed_everything
    from slime_async.train.ranks import FollowerSink, FollowerSource, LeaderSink, LeaderSource

    seed_everything(config.run.seed)
    publisher: WeightSink | None = None
    if ranks is not None and not ranks.leader:
        source = FollowerSource(ranks)
        publisher = FollowerSink(ranks) if engine_urls else None
    else:
        if source is None:
            raise ValueError("build_trainer: rank 0 needs a batch source")
        publisher = build_publisher(config, engine_urls) if engine_urls else None
        if ranks is not None:
            source = LeaderSource(source, ranks)
            publisher = LeaderSink(publisher, ranks) if publisher is not None else None
    trainer = Trainer(
        config.train,
        backend if backend is not None else build_backend(config),
        source,
        batch_size=config.rollout.batch_size,
        temperature=config.rollout.sampling.temperature,
        publisher=publisher,
        checkpoint_dir=run_dir(config) / "checkpoints",
        extra_state=extra_state,
        release_memory=bool(config.sync.release_memory),
        ranks=ranks,
    )
    trainer.give_up_after = config.sync.give_up_after
    return trainer
