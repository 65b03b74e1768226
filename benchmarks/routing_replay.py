"""Routing replay on the tiny MoE: how far the trainer's logprobs are from the engine's, with and without.

Runs of `configs/local_moe.yaml` from the same cached warm-start and seed, with
`train.moe.routing_replay` on and off, each for a fixed budget of RL, synchronous
(`rollout.max_staleness=0`), so that every trained token was sampled by the very weights the trainer
then holds and the engine/trainer gap is numerics and routing alone (no staleness). Two precisions:
float32, where the embedded engine and the torch trainer compute the same sums in the same order
(nothing for replay to correct), and bfloat16 (`model.dtype`: engine and trainer, from a bfloat16
warm-start), where the engine's batched decode and the trainer's full forward round differently, as
SGLang's kernels and Megatron's do on a GPU, and near-tied router scores then pick other experts.
From every step:

- `|dlogp|`: mean |trainer logprob - engine logprob| over the trained tokens (`behav_prox_abs_dlogp`),
- `ratio out`: share of tokens whose trainer/engine probability ratio leaves [0.8, 1.2] (what PPO's clip
  would clip with the engine as the anchor; `behav_ratio_out`),
- `routes replayed`: with replay, the share of (token, layer) routes where the engine's experts differed
  from the ones the trainer would have chosen (`moe/route_mismatch`): the tokens replay corrected.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = "tiny-moe: trainer vs engine logprob gap and clipped share with/without routing replay (sync RL)"


def _mean(records: list[dict[str, Any]], key: str) -> float:
    values = [r.get("metrics", r).get(key) for r in records]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def run(quick: bool = False) -> Result:
    minutes = 1.0 if quick else 3.0
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-routing-replay-") as tmp:
        for dtype in ("float32", "bfloat16"):
            for replay in (True, False):
                name = f"{dtype}-replay-{'on' if replay else 'off'}"
                s = run_training("configs/local_moe.yaml", name, Path(tmp), [
                    f"model.dtype={dtype}", f"train.moe.routing_replay={str(replay).lower()}",
                    "rollout.max_staleness=0", f"train.time_limit_s={minutes * 60}", "train.steps=100000",
                    "data.eval_every=0"])
                recs = s["records"]
                row = [name, s["steps"], _mean(recs, "behav_prox_abs_dlogp"), _mean(recs, "behav_ratio_out"),
                       _mean(recs, "moe/route_mismatch") if replay else "-", s["success_after"]["sampled"]]
                rows.append(row)
                runs[name] = {"steps": s["steps"], "success_after": s["success_after"],
                              "per_step": [(r["version"], r.get("metrics", r).get("behav_prox_abs_dlogp"),
                                            r.get("metrics", r).get("behav_ratio_out"),
                                            r.get("metrics", r).get("moe/route_mismatch")) for r in recs]}
    by = {row[0]: row for row in rows}

    def gap(dtype: str) -> str:
        on, off = by[f"{dtype}-replay-on"], by[f"{dtype}-replay-off"]
        factor = off[2] / on[2] if on[2] else float("inf")
        return (f"{dtype} {off[2]:.2e} -> {on[2]:.2e} ({factor:.1f}x less; ratio outside [0.8, 1.2] "
                f"{off[3]:.3%} -> {on[3]:.3%}; {on[4]:.2%} of routes replayed other experts)")

    return Result(
        columns=["run", "steps", "|dlogp| trainer vs engine", "ratio out of [0.8, 1.2]", "routes replayed",
                 "success after (sampled)"],
        rows=rows,
        headline=f"routing replay, mean |trainer - engine logprob|: {gap('bfloat16')}; {gap('float32')}",
        details={"runs": runs, "minutes": minutes},
    )
