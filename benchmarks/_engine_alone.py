"""One engine alone on warm-started weights, driven by `slime-async rollout` at hand-set concurrencies and
with adaptive concurrency: shared by `bench e2e_gpu` (the standalone generation rate, the bound's other
half) and `bench adaptive_concurrency` (the rule against the best hand-set value, on CPU)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._runs import REPO


def warm_started(model: Path, config: str, overrides: list[str]) -> Path:
    """The warm-start of `model` that `train` runs under `config` (the same cache entry): found in the
    cache, or trained now in a process of its own (so that this one holds no GPU memory after it)."""
    from slime_async.config.loader import load_config
    from slime_async.models.tiny_model import default_cache_dir
    from slime_async.train.warmstart import warmstart_dir

    args = [str(REPO / config), f"model.path={model}", *overrides]
    subprocess.run([sys.executable, "-c", "import sys; from benchmarks._engine_alone import _warm_main; "
                    "_warm_main(sys.argv[1], sys.argv[2:])", *args], cwd=REPO, check=True)
    out = warmstart_dir(load_config(args[0], args[1:]), model, default_cache_dir())
    if not (out / "config.json").is_file():
        raise RuntimeError(f"the warm-start of {model} left no model at {out}")
    return out


def _warm_main(config: str, overrides: list[str]) -> None:
    from slime_async.config.loader import load_config
    from slime_async.models.tiny_model import default_cache_dir
    from slime_async.train.warmstart import warm_start

    cfg = load_config(config, overrides)
    path, cached = warm_start(cfg, Path(cfg.model.path), default_cache_dir())
    print(f"  warm-start {'found in the cache' if cached else 'trained'}: {path}", flush=True)


def generation_alone(model: Path, tmp: Path, config: str, groups: int = 96, concurrencies: tuple[int, ...] = (),
                     overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """The warm-started model in one engine (as `config`'s run has it), and `slime-async rollout` against
    it at each hand-set concurrency and with adaptive concurrency (its ceiling the largest hand-set
    value): episodes and tokens per second, and for the adaptive row the limits it chose. `overrides`
    apply to every row (an env's tool latency, say). A first rollout of a few groups, not counted, pays
    the one-time costs (the first replays of each CUDA graph, the tokenizer) that would otherwise all
    fall on the first row."""
    from slime_async.config.loader import load_config
    from slime_async.launch.process import start_engine
    from slime_async.launch.rollout_run import rollout_to_file

    if not concurrencies:
        raise ValueError("generation_alone needs at least one hand-set concurrency")
    cfg = load_config(str(REPO / config))
    engine = start_engine(model, "--device", cfg.model.device, "--dtype", cfg.model.dtype, "--max-batch-size",
                          str(cfg.engine.max_batch_size), timeout=300)
    rows = []
    try:
        for concurrency in ["warm-up", *concurrencies, "adaptive"]:
            adaptive = concurrency == "adaptive"
            limit = concurrency if isinstance(concurrency, int) else max(concurrencies)  # adaptive: the ceiling
            run_cfg = load_config(str(REPO / config), [
                f"engine.urls=[{engine.url}]", f"model.path={model}", f"rollout.max_concurrency={limit}",
                f"rollout.adaptive_concurrency={str(adaptive).lower()}", *(overrides or [])])
            began = time.monotonic()
            limits: list[int] = []
            stats = rollout_to_file(run_cfg, model, tmp / f"rollout-{concurrency}.jsonl",
                                    max(1, groups // 8) if concurrency == "warm-up" else groups, "train",
                                    limits=limits)
            seconds = time.monotonic() - began
            if concurrency == "warm-up":
                continue
            s = stats.summary()
            rows.append({"concurrency": concurrency, "episodes": s["episodes"], "seconds": seconds,
                         "episodes_per_s": s["episodes"] / seconds, "tokens_per_s": stats.tokens / seconds,
                         "turns_per_s": stats.turns / seconds,
                         "limit_median": statistics.median(limits) if limits else None,
                         "limit_last": limits[-1] if limits else None})
            print(f"  generation alone, concurrency {concurrency}: {s['episodes'] / seconds:.1f} episodes/s, "
                  f"{stats.tokens / seconds:.0f} tokens/s"
                  + (f", limit {rows[-1]['limit_median']:.0f} (median), {limits[-1]} (last)" if adaptive and limits
                     else ""), flush=True)
    finally:
        engine.stop()
    return rows
