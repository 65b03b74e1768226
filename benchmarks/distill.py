"""On-policy distillation against RL alone: the same tiny student, the same start, the same time budget.

The teacher is a larger tiny Qwen2 (hidden 384 instead of 256: 7.2M parameters, 2.1x the student's
3.4M; the student's tokenizer) warm-started on calculator demonstrations that all use the tool, to high held-out success
(cached like every warm-start). The student is `configs/local.yaml`'s warm-started tiny model (the
cached warm-start the learning bench starts from). Two real `slime-async train` runs follow, side by
side in the table: RL alone (the config as it is) and RL with `train.distill` naming the teacher (the
launcher starts its embedded engine; it shares the cores with everything else), each with RL bounded
to the same wall-clock minutes. The held-out success during RL comes from the evaluation worker's rounds.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import asdict
from pathlib import Path

import msgspec

from benchmarks import Result
from benchmarks._runs import REPO, crossing_s, run_training

DESCRIPTION = ("on-policy distillation from a 2x larger warm-started teacher vs RL alone, same student start and "
               "RL minutes: held-out sampled success over time (goal: distillation ahead)")
TEACHER_SPEC = {"hidden_size": 384, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2, "intermediate_size": 1152}
"""Wider than tiny's 256 (same depth, same tokenizer: `bpe_vocab_size` and seed unchanged)."""
TEACHER_STAGES = "warmstart.stages=[{examples: 6400, env_args: {demo_tool_fraction: 1.0}}]"
"""200 steps of 32 demonstrations that all call the tool: the skill, without the mix that makes the
student's warm-start answer at once most of the time."""


def teacher(quick: bool) -> tuple[Path, dict]:
    """The warm-started teacher's directory (trained now or cached) and its held-out success."""
    from slime_async.config import load_config
    from slime_async.launch.success_check import measure_success
    from slime_async.models.tiny_model import ModelSpec, default_cache_dir, make_model
    from slime_async.train.warmstart import warm_start

    base = default_cache_dir() / "models" / "distill-teacher-seed0"
    if not (base / "config.json").is_file():
        make_model(base, ModelSpec(**TEACHER_SPEC), seed=0)
    stages = TEACHER_STAGES.replace("6400", "640") if quick else TEACHER_STAGES
    cfg = load_config(REPO / "configs/local.yaml", [f"model.path={base}", stages, "warmstart.seed=0"])
    print(f"  teacher: warm-start of {base.name} ({stages})", flush=True)
    path, cached = warm_start(cfg, base, default_cache_dir(), None)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(path)))
    success = asyncio.run(measure_success(cfg, path, 128 if quick else 512))
    print(f"  teacher: {path} ({'cached' if cached else 'trained'}), {success.sampled:.1%} sampled, "
          f"{success.greedy:.1%} greedy held-out", flush=True)
    return path, asdict(success)


def run(quick: bool = False) -> Result:
    minutes = 1.5 if quick else 4.0
    teacher_dir, teacher_success = teacher(quick)
    common = ["run.seed=0", "warmstart.seed=0", f"train.time_limit_s={minutes * 60}", "train.steps=100000",
              "data.eval_every=10"]
    arms = {"RL alone": [], "RL + distillation": [f"train.distill.model={teacher_dir}"]}
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        for name, extra in arms.items():
            s = run_training("configs/local.yaml", name.split()[-1].replace("alone", "rl"), Path(tmp),
                             common + extra)
            before, after = s["success_before"], s["success_after"]
            curve = [(round(r["time"] - (s["records"][0]["time"] - s["records"][0]["seconds"]), 1),
                      r["version"], r["eval/held_out/pass@1"]) for r in s["eval"] if "eval/held_out/pass@1" in r]
            half = crossing_s(s, "eval/held_out/pass@1", 0.5)
            teacher_books = [w.get("distill") for w in s["rollout"] if w.get("distill")]
            rows.append([name, before["sampled"], after["sampled"], after["greedy"], s["steps"], round(s["rl_s"]),
                         half if half is not None else "-", max((c[2] for c in curve), default=None)])
            runs[name] = {k: v for k, v in s.items() if k != "records"} | {
                "eval_curve": curve, "teacher": teacher_books,
                "reverse_kl": [(r["version"], r.get("distill/reverse_kl")) for r in s["records"]]}
    rl, distill = rows[0][2], rows[1][2]
    ahead = "ahead of" if distill > rl else "NOT ahead of"
    return Result(
        columns=["arm", "before sampled", "after sampled", "after greedy", "steps", "RL s", "s to 50% (eval)",
                 "best eval"],
        rows=rows,
        headline=(f"held-out sampled success after {minutes:g} min of RL from {rows[0][1]:.1%}: distillation "
                  f"{distill:.1%} vs RL alone {rl:.1%}, {ahead} RL (teacher {teacher_success['sampled']:.1%}; "
                  "2 CPU cores shared with other jobs)"),
        details={"teacher": {"path": str(teacher_dir), "spec": TEACHER_SPEC, "success": teacher_success},
                 "minutes": minutes, "runs": runs},
    )
