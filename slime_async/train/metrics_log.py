"""Where a run's numbers go: a JSON-lines file always, TensorBoard and Weights & Biases when configured.

The JSONL file is the record the run summary and the benchmarks read; TensorBoard event files
(`<run dir>/tensorboard/`) and wandb are views of the same scalars, under the same names. Nested
values (counters) are flattened with `/`; non-numbers go to the JSONL file only.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from slime_async.config import ConfigError
from slime_async.config.schema import LogConfig


def check_log_config(cfg: LogConfig) -> None:
    """Fail before anything starts when a configured logger cannot work here."""
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb_project: {cfg.wandb_project!r} is set but wandb is not installed; "
                          "`pip install wandb` (and `wandb login`), or remove log.wandb_project")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard: the tensorboard package is not installed; `pip install tensorboard` "
                          "or set log.tensorboard: false")


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of `record`, nested keys joined with `/`."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, int | float):  # bools too: True is 1.0
            out[name] = float(value)
    return out


class MetricsLog:
    """Append records to `path` and mirror their scalars to TensorBoard/wandb at `step`."""

    def __init__(self, path: Path, cfg: LogConfig, run_dir: Path, run_name: str, writer_name: str = "train") -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # one sub-directory per writing process: TensorBoard merges them as runs of one experiment
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard" / writer_name))
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, name=f"{run_name}-{writer_name}",
                                    dir=str(run_dir), resume="allow")

    def write(self, record: dict[str, Any], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        values = scalars(record)
        if self.tb is not None:
            for name, value in values.items():
                self.tb.add_scalar(name, value, step)
            self.tb.flush()  # a live TensorBoard sees each step as it lands
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
