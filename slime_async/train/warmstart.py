"""The supervised warm-start: a few minutes of next-token training on demonstrations, before RL.

RL learns only from episodes that sometimes succeed: a random tiny model never calls the tool
right, every reward is 0 and nothing is learned. The warm-start teaches the form of a correct
episode from the env's own demonstrations (`Env.demonstration(args, task)`: the assistant's
replies), rendered through `run_episode` with a `ScriptedPolicy`, so that the training tokens are
exactly the tokens the engines will see (chat template, tool results, loss masks on the model's
replies only).

The result is a HF model directory in the cache, keyed by everything that shapes it (the base
model's files, the env and its arguments, the `warmstart` settings, the seed): a second run with
the same settings reuses it at once. Training on CPU is deterministic for a seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from slime_async.agents.server import close_shared_server
from slime_async.config import ConfigError
from slime_async.config.schema import Config, EnvConfig, WarmstartConfig, WarmstartStage
from slime_async.env import EnvFactory, ScriptedPolicy, run_episode
from slime_async.train.backend import Logprobs
from slime_async.train.batch import Batch, build_batch
from slime_async.types import Task, Trajectory

log = logging.getLogger("slime_async.train.warmstart")

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
Progress = Callable[[int, int, float], None]
"""Called after each optimizer step with (step, steps, loss)."""


DEFAULT_EXAMPLES = 4096
"""Demonstrations when neither `warmstart.examples` nor `warmstart.stages` is given."""


class WarmstartError(ConfigError):
    """The warm-start cannot run as configured; the message names the field and the fix (the CLI
    prints it as one line, as it does every ConfigError)."""


def cache_key(cfg: Config, base_dir: Path) -> str:
    """A digest of everything the warm-started weights depend on."""
    h = hashlib.sha256()
    for name in MODEL_FILES:
        f = base_dir / name
        if f.is_file():
            h.update(name.encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    # the check does not shape the weights; the seed is keyed as resolved
    # (and the env is keyed as resolved: naming the run's own env in `warmstart.env` is the same warm-start)
    ws = msgspec.structs.replace(cfg.warmstart, min_success=0.0, check_tasks=0, seed=None, env=None)
    env = demo_env(cfg)
    # The env's source file: an edited `demonstration` (or task generator) must not find the old cache.
    source = inspect.getsourcefile(EnvFactory.from_config(env.name, env.args).cls)
    if source is not None:
        h.update(Path(source).read_bytes())
    h.update(json.dumps({"env": env.name, "args": env.args, "warmstart": msgspec.to_builtins(ws),
                         "seed": seed_of(cfg), "dtype": cfg.model.dtype}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def demo_env(cfg: Config) -> EnvConfig:
    """The env whose demonstrations the warm-start trains on: `warmstart.env`, else the run's."""
    return cfg.warmstart.env or cfg.env


def warmstart_dir(cfg: Config, base_dir: Path, cache_root: Path) -> Path:
    return cache_root / "warmstart" / f"{base_dir.name}-{cache_key(cfg, base_dir)}"


async def demonstrations(factory: EnvFactory, tokenizer: Any, count: int, seed: int) -> list[Trajectory]:
    """`count` demonstration episodes on the env's train tasks (shuffled by `seed`), token-exact."""
    try:
        tasks = list(factory.tasks("train"))
    except NotImplementedError:
        raise WarmstartError(f"warmstart.enabled: env {factory.name} does not generate its own tasks, and the "
                             "warm-start demonstrates on those; set warmstart.enabled: false") from None
    if not tasks:
        raise WarmstartError(f"warmstart: env {factory.name} has no train tasks to demonstrate")
    random.Random(seed).shuffle(tasks)
    chosen = [tasks[i % len(tasks)] for i in range(count)]
    replies = []
    for task in chosen:
        try:
            replies.append(factory.cls.demonstration(factory.args, task))
        except NotImplementedError:
            raise WarmstartError(
                f"warmstart.enabled: env {factory.name} has no demonstrations (it does not override "
                "Env.demonstration); set warmstart.enabled: false or write one") from None
    # concurrently: tools may take their time (a sandbox, a search, injected latency)
    gate = asyncio.Semaphore(256)

    async def one(task: Task, script: list[str]) -> Trajectory:
        async with gate:
            return await run_episode(factory.new(), task, ScriptedPolicy(script, tokenizer), tokenizer,
                                     env_name=factory.name)

    try:
        out = await asyncio.gather(*(one(t, r) for t, r in zip(chosen, replies, strict=True)))
    finally:
        await close_shared_server()  # an agent env demonstrates through its endpoint
    for task, traj in zip(chosen, out, strict=True):
        if traj.reward <= 0:
            raise WarmstartError(f"warmstart: the demonstration of task {task.id} ({task.prompt!r}) earns reward "
                                 f"{traj.reward} (stop: {traj.stop_reason}); Env.demonstration must succeed")
    return list(out)


def stages_of(ws: WarmstartConfig) -> list[WarmstartStage]:
    """The configured curriculum, or one stage of `examples` demonstrations."""
    return list(ws.stages) or [WarmstartStage(examples=ws.examples or DEFAULT_EXAMPLES)]


def seed_of(cfg: Config) -> int:
    return cfg.warmstart.seed if cfg.warmstart.seed is not None else cfg.run.seed


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at `steps`: the multiplier of the peak rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def sft_loss(total_tokens: int) -> Callable[[Batch, slice, Logprobs], tuple[torch.Tensor, dict[str, float]]]:
    """Mean negative log-likelihood over the trained tokens of the whole batch (micro-batches add up)."""

    def loss_fn(mb: Batch, rows: slice, out: Logprobs) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.loss_mask.to(out.logprobs.device)
        nll = -(out.logprobs * mask).sum() / total_tokens
        return nll, {"nll": float(nll.detach())}

    return loss_fn


def train_sft(cfg: Config, base_dir: Path, out_dir: Path, progress: Progress | None = None) -> dict[str, float]:
    """Train `base_dir` on demonstrations and save a HF directory (with the tokenizer) to `out_dir`."""
    from transformers import AutoTokenizer

    from slime_async.train.backend import OptimizerSettings
    from slime_async.train.loop import seed_everything
    from slime_async.train.torch_backend import TorchBackend

    ws = cfg.warmstart
    seed = seed_of(cfg)
    seed_everything(seed)
    plan = []  # (stage, its env factory): every stage's args checked before anything is trained
    env = demo_env(cfg)
    for i, stage in enumerate(stages_of(ws)):
        try:
            plan.append((stage, EnvFactory.from_config(env.name, {**env.args, **stage.env_args})))
        except ValueError as exc:
            if not stage.env_args:
                raise  # env.args itself: its error names it
            raise WarmstartError(f"warmstart.stages[{i}].env_args: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    started = time.perf_counter()
    stages = []
    for i, (stage, factory) in enumerate(plan):
        # each stage its own draw of tasks (seed + i), so that stages do not repeat the same problems
        demos = asyncio.run(demonstrations(factory, tokenizer, stage.examples, seed + i))
        built = build_batch(demos, cfg.train.max_seq_len, "truncate")
        if built.batch is None:
            raise WarmstartError(f"warmstart: no demonstration of stage {i} has trainable tokens "
                                 f"({dict(built.skipped)})")
        stages.append(built.batch)
    backend = TorchBackend(base_dir, device=cfg.model.device, dtype=cfg.model.dtype,
                           optim=OptimizerSettings(lr=ws.lr, grad_clip=cfg.train.grad_clip),
                           micro_batch_size=ws.batch_size)
    steps = ws.epochs * sum(len(data) // ws.batch_size for data in stages)
    sched = torch.optim.lr_scheduler.LambdaLR(backend.optimizer, lambda s: lr_factor(s, steps, ws.warmup_steps))
    gen = torch.Generator().manual_seed(seed)
    step, loss = 0, float("nan")
    for data in stages:
        for _ in range(ws.epochs):
            order = torch.randperm(len(data), generator=gen)
            for start in range(0, len(data) - ws.batch_size + 1, ws.batch_size):
                rows = order[start:start + ws.batch_size]
                mb = _select(data, rows)
                result = backend.train_step(mb, sft_loss(max(1, mb.num_trained_tokens)), temperature=1.0)
                sched.step()
                step += 1
                loss = result.loss
                if progress is not None:
                    progress(step, steps, loss)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    backend.model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name in ("chat_template.jinja",):  # kept byte-identical: the renderer's append-only check reads it
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, tmp / name)
    report = {"demonstrations": sum(len(data) for data in stages), "steps": step, "final_nll": loss,
              "seconds": time.perf_counter() - started,
              "trained_tokens": sum(data.num_trained_tokens for data in stages)}
    (tmp / "warmstart.json").write_text(json.dumps(report, indent=2))
    try:
        tmp.rename(out_dir)  # atomic: a concurrent run either sees the whole directory or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another run finished first; its result is the same
    return report


def _select(batch: Batch, rows: torch.Tensor) -> Batch:
    picked = Batch(
        input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
        loss_mask=batch.loss_mask[rows], behaviour_logprobs=batch.behaviour_logprobs[rows],
        rewards=batch.rewards[rows], group_index=batch.group_index[rows], min_versions=batch.min_versions[rows],
        trajectory_ids=[batch.trajectory_ids[i] for i in rows.tolist()],
    )
    return picked.rows(0, len(picked))  # trimmed to its own longest row


def warm_start(cfg: Config, base_dir: Path, cache_root: Path, progress: Progress | None = None) -> tuple[Path, bool]:
    """The warm-started model directory for `cfg` (trained now, or found in the cache).
    Returns (directory, whether it came from the cache)."""
    check_settings(cfg.warmstart)
    out = warmstart_dir(cfg, base_dir, cache_root)
    if (out / "config.json").is_file():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    report = train_sft(cfg, base_dir, out, progress)
    log.info("warm-start: %s", report)
    return out, False


def check_settings(ws: WarmstartConfig) -> None:
    if ws.stages and ws.examples is not None:
        raise WarmstartError("warmstart.examples and warmstart.stages: give one (each stage has its own examples); "
                             "to train one set of demonstrations on a config with stages, add warmstart.stages=[]")
    if not ws.stages and (ws.examples or DEFAULT_EXAMPLES) < ws.batch_size:
        raise WarmstartError(f"warmstart.examples: {ws.examples} is fewer than warmstart.batch_size "
                             f"{ws.batch_size}; no step could be taken")
    for i, stage in enumerate(ws.stages):
        if stage.examples < ws.batch_size:
            raise WarmstartError(f"warmstart.stages[{i}].examples: {stage.examples} is fewer than "
                                 f"warmstart.batch_size {ws.batch_size}; the stage could take no step")
