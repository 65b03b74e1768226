"""Evaluation suites: several named datasets, each with its env, sampling and metrics, run over the Scheduler.

`suites_from_config(cfg)` builds the suites of `data.eval`; `run_suites(suites, client, tokenizer)`
runs them concurrently (one Scheduler each, into a ListSink, no group filtering, no staleness
bound: evaluation never trains) and returns an `EvalResult` per suite, whose `flat()` gives
`eval/NAME/pass@k`, `eval/NAME/mean_reward`, ... for the metrics stream. It is async and shares
the event loop: a trainer or launcher runs it as a task beside rollout, on its own SGLangClient
(each Scheduler registers a version listener on the client it is given). A group with an episode
that failed (server or env error) is not scored: it is counted in `dropped_tasks`.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from slime_async.config.schema import Config
from slime_async.data.build import build_envs, env_factory, open_source, row_format
from slime_async.data.router import EnvRouter
from slime_async.data.stream import TaskStream
from slime_async.env import EnvFactory, Limits, Sampling, VerifierPool
from slime_async.evaluation.metrics import group_metrics
from slime_async.rollout import ListSink, RolloutStats, Scheduler, SGLangClient
from slime_async.types import Task, Trajectory

_NO_BOUND = 1 << 30


@dataclass
class EvalSuite:
    """One named dataset with everything needed to evaluate on it."""

    name: str
    envs: EnvFactory | EnvRouter
    tasks: list[Task]
    n_samples: int = 1
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.0))
    pass_k: list[int] = field(default_factory=lambda: [1])
    threshold: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this."""
    skipped_rows: int = 0
    """Bad rows skipped while reading the dataset."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"eval suite {self.name!r} has no tasks")
        if any(k > self.n_samples for k in self.pass_k):
            raise ValueError(f"eval suite {self.name!r}: pass_k {self.pass_k} needs n_samples >= {max(self.pass_k)}")


@dataclass
class EvalResult:
    name: str
    metrics: dict[str, float]
    groups: list[list[Trajectory]]
    stats: RolloutStats

    def flat(self, prefix: str = "eval") -> dict[str, float]:
        """`{prefix}/{name}/{metric}` keys, for the metrics stream and the run summary."""
        return {f"{prefix}/{self.name}/{k}": v for k, v in self.metrics.items()}


def suites_from_config(cfg: Config) -> list[EvalSuite]:
    """The suites of `data.eval`, their tasks read now (bad rows skipped and counted per `data.on_bad_row`)."""
    suites = []
    for s in cfg.data.eval:
        envs: EnvFactory | EnvRouter = env_factory(s.env) if s.env is not None else build_envs(cfg)
        source = open_source(s, envs if isinstance(envs, EnvFactory) else None, name=s.name)
        stream = TaskStream(source, row_format(s), epochs=1, on_bad_row=cfg.data.on_bad_row,
                            validate=envs.check if isinstance(envs, EnvRouter) else None)
        tasks = list(itertools.islice(stream, s.max_tasks))
        if s.sampling is not None:
            sampling = Sampling.from_config(s.sampling)
        else:
            sampling = Sampling(temperature=0.0, max_new_tokens=cfg.rollout.sampling.max_new_tokens)
        suites.append(EvalSuite(name=s.name, envs=envs, tasks=tasks, n_samples=s.n_samples, sampling=sampling,
                                pass_k=list(s.pass_k), skipped_rows=stream.state().skipped))
    return suites


async def run_suite(suite: EvalSuite, client: SGLangClient, tokenizer: Any, *, max_concurrency: int = 64,
                    limits: Limits | None = None, verifiers: VerifierPool | None = None) -> EvalResult:
    """Every task of the suite, `n_samples` times; metrics from the finished groups."""
    sink = ListSink()
    scheduler = Scheduler(
        suite.envs, suite.tasks, client, tokenizer, sink, group_size=suite.n_samples,
        batch_size=max(1, len(suite.tasks) * suite.n_samples), max_staleness=_NO_BOUND,
        max_concurrency=max_concurrency, sampling=suite.sampling, limits=limits,
        filter_equal_rewards=False, verifiers=verifiers,
    )
    stats = await scheduler.run()
    metrics = group_metrics(sink.groups, suite.pass_k, suite.threshold)
    metrics["dropped_tasks"] = float(sum(stats.groups_dropped.values()))
    metrics["skipped_rows"] = float(suite.skipped_rows)
    return EvalResult(suite.name, metrics, sink.groups, stats)


async def run_suites(suites: list[EvalSuite], client: SGLangClient, tokenizer: Any, **kwargs: Any
                     ) -> dict[str, EvalResult]:
    """All suites concurrently; results by suite name."""
    results = await asyncio.gather(*(run_suite(s, client, tokenizer, **kwargs) for s in suites))
    return {r.name: r for r in results}
