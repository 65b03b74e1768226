"""One trajectory for the viewer (its turns, tokens with mask, version and logprob), and its export file.

The export is one JSON document that `slime-async replay FILE` reads back: the trajectory itself
(`types.codec`'s JSON, every token with its logprob, version and mask), the step that trained it and
its advantage, and the run's resolved config (the env, its arguments, limits and sampling), so that
the episode can be run again from the file alone.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from slime_async.dashboard.store import TrajectoryStore
from slime_async.types import Trajectory, to_json

EXPORT_FORMAT = "slime-async-trajectory/1"


def detail(store: TrajectoryStore, traj_id: str, run_dir: Path) -> dict[str, Any]:
    """What the viewer shows of one trajectory. KeyError when the store has no such id."""
    summary, traj, texts = store.get(traj_id)
    ids: set[int] = set()
    turns = []
    for turn, (prompt_text, completion_text) in zip(traj.turns, texts, strict=True):
        prompt_ids = turn.prompt_ids.tolist()
        completion_ids = turn.completion_ids.tolist()
        ids.update(prompt_ids)
        ids.update(completion_ids)
        turns.append({"prompt_text": prompt_text, "completion_text": completion_text, "prompt_ids": prompt_ids,
                      "completion_ids": completion_ids, "logprobs": [round(x, 5) for x in turn.logprobs.tolist()],
                      "versions": turn.versions.tolist(), "mask": turn.loss_mask.tolist(),
                      "finish_reason": turn.finish_reason, "new_branch": turn.new_branch})
    pieces = store.pieces(ids)
    return {**summary, "turns": turns, "pieces": {str(k): v for k, v in pieces.items()},
            "rewards": traj.rewards, "metrics": traj.metrics, "timings": traj.timings, "error": traj.error,
            "errors": traj.errors, "replay": replay_command(run_dir, traj_id)}


def export_path(run_dir: Path, traj_id: str) -> Path:
    return run_dir / "exports" / f"{traj_id}.json"


def replay_command(run_dir: Path, traj_id: str) -> str:
    """The command the viewer shows: export (done by its link) then replay."""
    return f"slime-async replay {shlex.quote(str(export_path(run_dir, traj_id)))}"


def export_document(store: TrajectoryStore, traj_id: str, run_dir: Path) -> dict[str, Any]:
    """The export file's content (JSON-ready). KeyError when the store has no such id."""
    summary, traj, _ = store.get(traj_id)
    config = run_dir / "config.yaml"
    return {"format": EXPORT_FORMAT, "run_dir": str(run_dir), "step": summary["step"],
            "advantage": summary["advantage"], "config": config.read_text() if config.exists() else None,
            "trajectory": json.loads(to_json(traj))}


def write_export(store: TrajectoryStore, traj_id: str, run_dir: Path) -> Path:
    """Write the export file under `<run dir>/exports/` (where the replay command points)."""
    path = export_path(run_dir, traj_id)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(export_document(store, traj_id, run_dir), indent=1))
    tmp.replace(path)
    return path


def read_export(path: Path) -> tuple[dict[str, Any], Trajectory]:
    """An export file's document and its trajectory; ValueError naming the file when it is not one."""
    from slime_async.types import from_json

    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (the dashboard's 'export' link writes it)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); export the trajectory again") from None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: not a trajectory export (its 'format' should be {EXPORT_FORMAT!r})")
    try:
        traj = from_json(json.dumps(doc["trajectory"]), Trajectory)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: 'trajectory': {exc}") from None
    return doc, traj
