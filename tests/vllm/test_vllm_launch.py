"""Setting up vLLM engines: the command, its check by vLLM's own parser, and the errors that name
what to fix (no server is started here)."""

from __future__ import annotations

import sys

import pytest
from vllm_helpers import vllm_config

from slime_async.config import ConfigError
from slime_async.launch.vllm_command import check_with_vllm, vllm_argv


def argv(*overrides: str) -> list[str]:
    return vllm_argv(vllm_config(*overrides), model_path="/m", host="127.0.0.1", port=8000, index=1)


def test_the_command_passes_vllm_s_own_parser() -> None:
    command = argv()
    assert command[:2] == ["env", "VLLM_SERVER_DEV_MODE=1"]  # the pause, reload and version routes
    assert "--enable-scale-out" in command and command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert command[command.index("--seed") + 1] == "1" and command[command.index("--max-model-len") + 1] == "512"
    assert "--enable-lora" not in command and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" not in command
    # a LoRA run's adds the adapter routes and room for one adapter of its rank; one parse checks both
    # (its flags are the plain command's and more; vLLM's parser takes ~12 s to import)
    lora = argv("train.lora={rank: 12}")
    assert lora[:3] == ["env", "VLLM_SERVER_DEV_MODE=1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"]
    assert set(command[3:]) < set(lora[3:]) and "--enable-lora" in lora
    assert lora[lora.index("--max-loras") + 1] == "1"
    assert lora[lora.index("--max-lora-rank") + 1] == "16"  # vLLM takes 8, 16, 32...: the next one up
    check_with_vllm(lora)
    with pytest.raises(ValueError, match=r"vllm.args.max_lora_rank: set by the launcher"):
        argv("train.lora={rank: 8}", "vllm.args.max_lora_rank=64")


def test_a_misspelled_argument_fails_with_vllm_s_own_words() -> None:
    with pytest.raises(ValueError, match=r"unrecognized arguments: --max-model-lenght.*vllm.args"):
        check_with_vllm(argv("vllm.args.max_model_lenght=9"))


def test_arguments_the_launcher_owns_are_refused() -> None:
    with pytest.raises(ValueError, match=r"vllm.args.port: set by the launcher"):
        argv("vllm.args.port=9")


def test_a_missing_vllm_names_the_make_target(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"vllm.python: no interpreter at .*run `make vllm`"):
        argv(f"vllm.python={tmp_path}/python")


@pytest.mark.parametrize(("override", "message"), [
    ("sync.mode=tensor", "sync.mode: tensor does not reach vLLM engines"),
    ("engine.router.enabled=true", "engine.router.enabled: sglang-router speaks SGLang's API"),
    ("engine.host=0.0.0.0", "engine.host: 0.0.0.0: vLLM's weight-update routes"),
])
def test_settings_vllm_cannot_honour_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        vllm_config(override)


@pytest.mark.parametrize(("module", "message"), [
    (None, r"No module named 'vllm' \(make vllm installs"),
    ('__version__ = "0.20.1"\n', r"vLLM 0.20.1 is installed; slime_async needs vLLM >= 0.32"),
])
def test_an_interpreter_without_a_recent_vllm_is_named(tmp_path, monkeypatch, module, message) -> None:
    # an interpreter of our own, with no vLLM or with an old one on its path
    if module is not None:
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text(module)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(ValueError, match=rf"vllm.python: {sys.executable}: {message}"):
        check_with_vllm(argv(f"vllm.python={sys.executable}"))
