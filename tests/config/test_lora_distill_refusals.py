"""Settings that LoRA and distillation cannot honour are refused when the config loads, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_async.config import ConfigError, load_config

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_lora_run_loads_with_the_embedded_engine(backend: str) -> None:
    cfg = load_config(LOCAL, ["train.lora={rank: 4}", f"train.backend={backend}"])
    assert cfg.train.lora is not None and cfg.train.lora.rank == 4 and cfg.train.backend == backend


@pytest.mark.parametrize(("overrides", "field"), [
    (["engine.kind=vllm", "sync.mode=disk", "train.lora.rank=600"], "at most 512"),
    (["sync.release_memory=true"], "sync.release_memory"),
])
def test_lora_refuses_what_would_lose_the_frozen_weights(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.lora") as err:
        load_config(LOCAL, ["train.lora={rank: 4}", *overrides])
    assert field in str(err.value)


@pytest.mark.parametrize("override", ["rollout.sampling.temperature=0.7", "rollout.sampling.top_p=0.9",
                                      "rollout.sampling.top_k=20"])
def test_distillation_refuses_sampling_the_teacher_does_not_score(override: str, tmp_path: Path) -> None:
    base = ["train.distill.model=" + str(tmp_path)]
    assert load_config(LOCAL, base).train.distilling  # temperature 1, no top_p or top_k: loads
    with pytest.raises(ConfigError, match=r"train\.distill: rollout\.sampling must be temperature 1"):
        load_config(LOCAL, [*base, override])
