"""How often a model succeeds on held-out problems, measured through the real path before RL starts.

An embedded engine is started on the model directory and the env's eval-split problems are run
through the scheduler like any rollout, once at the rollout's own sampling (what RL will see) and
once greedily. `train` stops with a clear message when the sampled success is below
`warmstart.min_success`: RL needs some rewarded episodes to learn from.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from slime_async.config import Config, ConfigError
from slime_async.config.model_dir import resolve_model_path
from slime_async.env import EnvFactory, Sampling


class SuccessTooLow(ConfigError):
    """The model RL would start from succeeds less often than `warmstart.min_success`."""


@dataclass
class Success:
    sampled: float
    """Share of problems solved (reward >= 1) at `rollout.sampling`."""
    greedy: float
    tasks: int
    sampled_metrics: dict[str, float] = field(default_factory=dict)
    """Everything the sampled round measured: `mean_reward`, stop reasons, the env's `metric/NAME` means."""
    greedy_metrics: dict[str, float] = field(default_factory=dict)


async def measure_success(cfg: Config, model_dir: Path | None, num_tasks: int, urls: list[str] | None = None
                          ) -> Success:
    """Success on the first `num_tasks` held-out problems of the configured env: of the engines at
    `urls`, or of `model_dir` (default `model.path`) on embedded engines started for it (and
    stopped after)."""
    from transformers import AutoTokenizer

    from slime_async.agents import close_shared_server
    from slime_async.evaluation.suite import EvalSuite, run_suites
    from slime_async.launch.rollout_run import start_embedded_engines
    from slime_async.rollout.vllm_client import engine_client

    factory = EnvFactory.from_config(cfg.env.name, cfg.env.args)
    tasks = list(itertools.islice(factory.tasks("eval"), num_tasks))
    if not tasks:
        raise ConfigError(f"warmstart.check_tasks: env {cfg.env.name} has no eval-split problems to check on")
    sampled = Sampling.from_config(cfg.rollout.sampling)
    greedy = Sampling(temperature=0.0, max_new_tokens=sampled.max_new_tokens)
    suites = [EvalSuite("sampled", factory, tasks, sampling=sampled),
              EvalSuite("greedy", factory, tasks, sampling=greedy)]
    model_dir = model_dir or resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engines = [] if urls else await asyncio.to_thread(start_embedded_engines, cfg, model_dir)
    try:
        kind = cfg.engine.kind if urls else "embedded"  # the run's engines, or embedded ones for the check
        async with engine_client(kind, urls or [e.url for e in engines]) as client:
            results = await run_suites(suites, client, tokenizer)
    finally:
        await close_shared_server()  # an agent env's endpoint, when it started one
        for e in engines:
            e.stop()
    sampled_round, greedy_round = results["sampled"].metrics, results["greedy"].metrics
    return Success(sampled_round["pass@1"], greedy_round["pass@1"], len(tasks), sampled_round, greedy_round)


def check_success(cfg: Config, success: Success) -> None:
    """Raise SuccessTooLow when the sampled success is under the configured floor."""
    floor = cfg.warmstart.min_success
    if success.sampled < floor:
        raise SuccessTooLow(
            f"warmstart.min_success: the model RL would start from solves {success.sampled:.1%} of "
            f"{success.tasks} held-out problems when sampled (greedy {success.greedy:.1%}), below the floor "
            f"{floor:.1%}; RL cannot learn without rewarded episodes. Warm-start longer (warmstart.examples "
            "or warmstart.stages, warmstart.epochs, warmstart.lr), enable warmstart, or lower the floor")
