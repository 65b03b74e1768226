"""slime's `slime.rollout.rm_hub` as generate functions call it: `async_rm`, `batched_async_rm`, and
the rule-based scorers behind `--rm-type`, here on slime_async's own verifiers (`envs.verifiers`).

`--rm-type` values: `math` (1/0, math-verify), `f1` (SQuAD F1), `deepscaler` (the text after
`</think>`, 1/0 by math-verify; 0 without `</think>`), `dapo` (`{"score": 1 or -1, "acc", "pred"}`
from the last `\\boxed{}` or `Answer:`), and `boxed_` before any of them (score the last `\\boxed{}`
only). `remote_rm`, `gpqa`, `ifbench` and `random` are not provided: name a reward function instead.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from slime_async.data.slime_compat.sample import Sample

RM_TYPES = ("math", "f1", "deepscaler", "dapo")

_ANSWER = re.compile(r"Answer\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """The reward of one sample: the sample's own `custom_rm_path`, else `args.custom_rm_path` (a
    `module.function` path or, here, the function itself), else the `--rm-type` scorer."""
    from slime_async.data.slime_compat.loading import load_function

    for rm in (sample.custom_rm_path, getattr(args, "custom_rm_path", None)):
        if rm is not None:
            fn = load_function(rm, "reward") if isinstance(rm, str) else rm
            return await fn(args, sample, **kwargs)
    rm_type = str((sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    return await asyncio.to_thread(rule_based_reward, rm_type, sample.response, sample.label)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """Rewards of several samples. As in slime, a custom reward function is called once with the whole
    list (it must accept one); without one, each sample is scored by `--rm-type`."""
    from slime_async.data.slime_compat.loading import load_function

    rm = getattr(args, "custom_rm_path", None)
    if rm is not None:
        fn = load_function(rm, "reward") if isinstance(rm, str) else rm
        return list(await fn(args, samples, **kwargs))
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))


def rule_based_reward(rm_type: str, response: str, label: Any) -> Any:
    """slime's rule-based reward `rm_type` of `response` against `label`, on slime_async's verifiers."""
    from envs.verifiers import last_boxed, score

    if not rm_type:
        raise ValueError(
            "no reward: the sample has none, no reward function is named (env.args.reward) and "
            "no rm_type is set (env.args.rm_type)"
        )
    if rm_type.startswith("boxed_"):
        response, rm_type = last_boxed(response) or "", rm_type[len("boxed_") :]
    if rm_type == "math":
        return int(score("math", response, label))
    if rm_type == "f1":
        return score("f1", response, label)
    if rm_type == "deepscaler":
        if "</think>" not in response or label in ("", None):
            return 0
        return int(score("math", response.split("</think>")[-1], label))
    if rm_type == "dapo":
        return compute_score(response, str(label))
    raise NotImplementedError(
        f"rm_type {rm_type!r} is not provided here (only {', '.join(RM_TYPES)}, with an "
        "optional boxed_ prefix): name a reward function in env.args.reward"
    )


def compute_score(
    solution_str: str, ground_truth: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict[str, Any]:
    """Stands for `slime.rollout.rm_hub.math_dapo_utils.compute_score`: `{"score": 1.0 or -1.0, "acc":
    bool, "pred": str}`. The answer is the last `\\boxed{}` (with `strict_box_verify`, only that), else
    the last `Answer: ...` line; it is compared with math-verify, not DAPO's string normalisation."""
    from envs.verifiers import last_boxed, math_equal

    tail = solution_str[-300:]  # as DAPO: the answer is at the end, and this bounds the parse
    pred = last_boxed(tail)
    if pred is None and not strict_box_verify:
        found = _ANSWER.findall(tail)
        pred = found[-1] if found else None
    correct = pred is not None and math_equal(f"${pred}$", ground_truth) == 1.0
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
