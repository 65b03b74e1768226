"""Learning on a mixture-of-experts model: `configs/local_moe.yaml` (the embedded default on `tiny-moe`,
8 experts, top-2, routing replay on) before and after 8 minutes of async RL, 3 seeds; as `learning`."""

from __future__ import annotations

from benchmarks import Result
from benchmarks.learning import learning

DESCRIPTION = "tiny-moe (Qwen3-MoE, routing replay): held-out success after 8 min of async RL, 3 seeds (goal >= 80%)"
GOAL = 0.80
OVERRIDES_OF = "configs/local_moe.yaml"


def run(quick: bool = False, overrides: list[str] | None = None) -> Result:
    return learning(OVERRIDES_OF, GOAL, quick, what="tiny-moe: ", overrides=overrides)
