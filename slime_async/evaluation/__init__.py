"""Evaluation: how well the policy does on held-out tasks, beside training and around it.

Owns: metric computations over finished episodes (`metrics`: pass@k, mean reward, stop reasons,
tokens, versions, env metrics), evaluation suites run through the rollout scheduler against the
engines (`suite`: `EvalSuite`, `run_suites`, `suites_from_config` from the config's `data.eval`),
and the evaluation worker process (`worker`: `python -m slime_async.evaluation.worker`) that runs
the suites whenever the engines' weight version reaches the next multiple of `data.eval_every`.

Sits above `data` (task sources, env routing) and `rollout` (the scheduler and engine clients),
which it uses. Does not own: starting the worker beside a run or folding its results into the
summary (`launch`), the success check's thresholds (`launch.success_check`).
"""

from slime_async.evaluation.metrics import group_metrics, pass_at_k, reward_metrics
from slime_async.evaluation.suite import EvalResult, EvalSuite, run_suite, run_suites, suites_from_config

__all__ = [
    "EvalResult",
    "EvalSuite",
    "group_metrics",
    "pass_at_k",
    "reward_metrics",
    "run_suite",
    "run_suites",
    "suites_from_config",
]
