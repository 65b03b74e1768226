"""`rollout.partial_mode` by engine kind: SGLang's radix cache keeps prefixes of earlier weights unless the
engine is flushed with nothing running, so SGLang engines default to `abort` and refuse `in_place` unless
the radix cache is off; the others default to `in_place`."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_async.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_each_kind_gets_its_default() -> None:
    assert load_config(CONFIGS / "local.yaml", ["rollout.partial_mode=null"]).rollout.partial_mode == "in_place"
    sglang = load_config(CONFIGS / "sglang_gpu.yaml")  # sets no partial_mode
    assert sglang.engine.kind == "sglang" and sglang.rollout.partial_mode == "abort"


def test_sglang_in_place_is_refused_naming_both_ways_out() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.partial_mode: in_place with engine\.kind sglang") as err:
        load_config(CONFIGS / "sglang_gpu.yaml", ["rollout.partial_mode=in_place"])
    assert "rollout.partial_mode: abort" in str(err.value) and "sglang.disable_radix_cache: true" in str(err.value)
    cfg = load_config(CONFIGS / "sglang_gpu.yaml", ["rollout.partial_mode=in_place", "sglang.disable_radix_cache=true"])
    assert cfg.rollout.partial_mode == "in_place"
