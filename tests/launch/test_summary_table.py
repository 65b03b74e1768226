"""The end-of-run table, rendered as a log file would receive it."""

from __future__ import annotations

import io

from rich.console import Console

from slime_async.launch.train_run import summary_table


def rendered(summary: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=240).print(summary_table(summary))
    return out.getvalue()


def test_success_rows_add_the_mean_reward_when_the_check_measured_it() -> None:
    check = {"sampled": 0.25, "greedy": 0.0, "tasks": 256,
             "sampled_metrics": {"mean_reward": 0.509, "pass@1": 0.25}, "greedy_metrics": {"mean_reward": 0.0}}
    text = rendered({"steps": 3, "success_before": check, "rl_s": 10.0, "wall_s": 20.0})
    assert "25.0% sampled, 0.0% greedy (256 held-out); mean reward 0.509 sampled, 0.000 greedy" in text
    # a summary written before the check kept its rounds (no metrics) still renders
    old = {k: check[k] for k in ("sampled", "greedy", "tasks")}
    text = rendered({"steps": 3, "success_after": old, "wall_s": 20.0})
    assert "25.0% sampled, 0.0% greedy (256 held-out)" in text and "mean reward" not in text
