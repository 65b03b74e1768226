"""A few trajectories of a batch as readable text, for people looking at what the policy does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_async.types import Trajectory


def pick(trajectories: list[Trajectory], k: int = 2) -> list[Trajectory]:
    """The best- and the worst-rewarded trajectory (then others): what success and failure look like."""
    ranked = sorted(trajectories, key=lambda t: t.reward, reverse=True)
    chosen = [ranked[0], ranked[-1]] if len(ranked) > 1 else ranked[:1]
    return chosen[:k]


def render(traj: Trajectory, tokenizer: Any) -> str:
    """The whole episode as the model saw it (special tokens kept), with its reward and versions."""
    versions = [int(v) for turn in traj.turns for v in turn.versions]
    span = f"{min(versions)}..{max(versions)}" if versions else "-"
    text = "\n[... a new segment: the whole context again ...]\n".join(
        tokenizer.decode([int(i) for i in ids], skip_special_tokens=False) for ids, _, _ in traj.segments())
    return (f"reward {traj.reward:g} ({', '.join(f'{k} {v:g}' for k, v in traj.rewards.items()) or '-'}), "
            f"stop {traj.stop_reason.value}, token versions {span}, task {traj.task_id}\n\n```\n{text}\n```\n")


def append_samples(path: Path, trajectories: list[Trajectory], tokenizer: Any, version: int) -> None:
    """Append the chosen trajectories of the batch that trained `version` to `path` (Markdown)."""
    parts = [f"## version {version}\n"] + [render(t, tokenizer) for t in pick(trajectories)]
    with path.open("a") as f:
        f.write("\n".join(parts) + "\n")
