"""Shared fixtures: one tiny model per test session, made in a temporary cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import perturbed_copy
from transformers import AutoModelForCausalLM

# This process computes beside the engines and parts the tests start, on the same cores: one thread
# here, as the launcher gives one to every part but the busiest (launch.torch_threads). With two, on
# two shared cores, each small operation waited for a descheduled peer: HF's token-by-token decoding
# beside a busy engine 4-6x slower, small training steps up to 10x; large ones lose little.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory of the session's own, so that tests never touch the user's."""
    path = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    """The tiny model, made once per session the way `model.path: tiny` makes it."""
    from slime_async.models.tiny_model import cached_model_dir

    return cached_model_dir("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(cache_dir: Path) -> Path:
    """The tiny Qwen3-MoE model (`model.path: tiny-moe`), made once per session."""
    from slime_async.models.tiny_model import cached_model_dir

    return cached_model_dir("tiny-moe", seed=0)


@pytest.fixture(scope="session")
def varied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights whose greedy continuations vary from token to token."""
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("varied"), seed=0)


@pytest.fixture(scope="session")
def reference(varied_model_dir: Path) -> torch.nn.Module:
    """The same weights in this process, as HF's own model: what the engine must agree with."""
    return AutoModelForCausalLM.from_pretrained(varied_model_dir).eval()
