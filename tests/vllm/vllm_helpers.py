"""Helpers of the vLLM tests (the fixtures are in this directory's conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slime_async.config import Config, load_config
from slime_async.launch.process import ChildProcess

REPO = Path(__file__).resolve().parents[2]


def vllm_config(*overrides: str) -> Config:
    """configs/local_vllm.yaml with a shorter context (less KV cache to set up)."""
    return load_config(REPO / "configs/local_vllm.yaml", ["vllm.args.max_model_len=512", *overrides])


@dataclass
class VLLMServer:
    url: str
    process: ChildProcess
    model_dir: Path
