"""Staleness sweep: eta in {0, 1, 2, 4, 8}, naive PPO against decoupled PPO, same budget of steps.

Naive PPO clips the ratio against the behaviour policy (the engine's logprobs, up to eta versions
old); decoupled PPO (AReaL) clips against a proximal policy recomputed by the trainer and corrects
for the behaviour policy with a capped importance weight. AReaL's v0.3 report (Table 3) sees naive
PPO degrade from eta of about 4 while decoupled PPO holds. Whatever the pattern here, it is reported.
The staleness actually reached is in the table: on 2 cores generation may not run far ahead.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import Result
from benchmarks._runs import run_training

DESCRIPTION = "staleness sweep eta 0/1/2/4/8 x naive vs decoupled PPO: final held-out success and stability"


def run(quick: bool = False) -> Result:
    etas = [0, 2] if quick else [0, 1, 2, 4, 8]
    steps = 10 if quick else 40  # 10 runs of about 2.5 min each on 2 cores
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-staleness-") as tmp:
        for loss in ("ppo", "decoupled_ppo"):
            for eta in etas:
                name = f"{loss}-eta{eta}"
                # naive PPO's anchor is the behaviour policy itself (the `ppo` recipe alone would
                # recompute it and merely drop the correction)
                naive = ["train.proximal=behaviour"] if loss == "ppo" else []
                s = run_training("configs/local.yaml", name, Path(tmp), [
                    f"rollout.max_staleness={eta}", f"train.loss={loss}", f"train.steps={steps}",
                    "data.eval_every=0", *naive])
                runs[name] = {k: v for k, v in s.items() if k != "records"}
                recs = s["records"]
                stale = [r["max_staleness"] for r in recs]
                skipped = sum(len(r.get("skipped_steps", [])) for r in recs)
                rows.append([loss, eta, s["success_before"]["sampled"], s["success_after"]["sampled"],
                             s["success_after"]["greedy"], sum(stale) / len(stale), max(stale),
                             max(r["grad_norm"] for r in recs), skipped, s["rl_s"]])
    best = {loss: max(r[3] for r in rows if r[0] == loss) for loss in ("ppo", "decoupled_ppo")}
    at_max = {r[0]: r[3] for r in rows if r[1] == etas[-1]}
    return Result(
        columns=["loss", "eta", "before sampled", "after sampled", "after greedy", "mean staleness", "max staleness",
                 "max grad norm", "skipped steps", "RL s"],
        rows=rows,
        headline=(f"sampled success at eta {etas[-1]}: naive PPO {at_max['ppo']:.1%} (best {best['ppo']:.1%}), "
                  f"decoupled PPO {at_max['decoupled_ppo']:.1%} (best {best['decoupled_ppo']:.1%}) "
                  f"after {steps} steps"),
        details={"runs": runs, "steps": steps},
    )
