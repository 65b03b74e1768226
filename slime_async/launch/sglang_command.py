"""The command lines of SGLang servers and of sglang-router, built from the config.

`sglang_argv` turns the `sglang:` section (SGLang's ServerArgs fields, see `config.sglang`) plus
what the launcher decides itself (model path, host, port, seed, starting weight version, admin
key, the memory saver when engines release memory) into `python -m sglang.launch_server ...`,
flag by flag as SGLang's argument parser expects them. `check_with_sglang` parses such a command
with SGLang's own parser where SGLang is importable (the engine's node), so that a field SGLang
renamed fails before any GPU memory is touched. `router_argv` builds `sglang-router launch ...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slime_async.config import Config
from slime_async.config.sglang import server_args_spec, set_fields
from slime_async.moe.shape import is_moe


def sglang_argv(cfg: Config, *, model_path: str, host: str, port: int | str, index: int, weight_version: str,
                release_memory: bool = False, python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server` for engine `index` of the run."""
    fields = set_fields(cfg.sglang)
    fields.setdefault("dtype", cfg.model.dtype)  # float32 / bfloat16 are SGLang choices too
    if release_memory:
        fields["enable_memory_saver"] = True  # without it /release_memory_occupation frees nothing
    if cfg.train.moe.routing_replay and _is_moe(model_path):
        fields["enable_return_routed_experts"] = True  # without it a request's return_routed_experts is ignored
    owned: dict[str, Any] = {"model_path": model_path, "host": host, "port": port, "random_seed": cfg.run.seed + index,
                             "weight_version": weight_version}
    if cfg.engine.admin_token:
        owned["admin_api_key"] = cfg.engine.admin_token  # the publisher sends it as a Bearer token
    argv = [python, "-m", "sglang.launch_server"]
    for name, value in {**owned, **fields}.items():
        argv += flag_args(name, value)
    return argv


def _is_moe(model_path: str) -> bool:
    config = Path(model_path) / "config.json"
    if not config.is_file():  # a hub name or a path on another node: SGLang resolves it, we cannot tell
        return False
    return is_moe(SimpleNamespace(**json.loads(config.read_text())))


def flag_args(name: str, value: Any) -> list[str]:
    """The arguments that set ServerArgs field `name` to `value` on SGLang's command line."""
    entry = server_args_spec().get(name)
    if entry is None or entry["flag"] is None:
        raise ValueError(f"sglang.{name}: not a ServerArgs field with a command-line flag (SGLang "
                         f"{json.dumps(entry) if entry else 'has no such field'})")
    flag, kind = entry["flag"], entry["kind"]
    if kind == "bool":
        return [flag] if value else []
    if kind == "bool_optional":
        return [flag] if value else ["--no-" + flag.removeprefix("--")]
    if kind == "list" or (kind.startswith("action:") and isinstance(value, list)):
        return [flag, *(str(v) for v in value)]
    if kind == "json" and not isinstance(value, str):
        return [flag, json.dumps(value)]
    if isinstance(value, bool):  # YAML true for a string-typed field: SGLang's parsers read "true"
        return [flag, str(value).lower()]
    return [flag, str(value)]


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # raise instead of exiting the process
        raise ValueError(message)


def check_with_sglang(argv: list[str]) -> None:
    """Parse `argv` (as built by `sglang_argv`) with SGLang's own parser; ValueError names the problem.

    Needs SGLang importable (call `sglang_available()` first): on the engine's node it is.
    """
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]

    parser = _Parser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    start = argv.index("sglang.launch_server") + 1
    try:
        parser.parse_args(argv[start:])
    except ValueError as exc:
        raise ValueError(f"SGLang's own parser refuses the engine command ({exc}); check the sglang: section "
                         f"against the installed SGLang and regenerate the extract "
                         f"(python -m slime_async.config.sglang_extract)") from None


def preflight(argv: list[str]) -> None:
    """Before an engine server starts: parse its command with the installed SGLang's own parser, where
    SGLang is importable (on the node that runs it), or vLLM's. Other commands pass untouched."""
    from slime_async.launch.vllm_command import SERVER_MODULE, check_with_vllm

    if "sglang.launch_server" in argv and sglang_available():
        check_with_sglang(argv)
    if SERVER_MODULE in argv:
        check_with_vllm(argv)


def router_executable() -> str:
    """`sglang-router` beside this interpreter (a virtual environment's bin), else on PATH."""
    beside = Path(sys.executable).with_name("sglang-router")
    found = str(beside) if beside.exists() else shutil.which("sglang-router")
    if found is None:
        raise FileNotFoundError("sglang-router is not installed: pip install sglang-router")
    return found


def router_argv(cfg: Config, worker_urls: list[str], host: str, port: int | str, metrics_port: int | str) -> list[str]:
    """`sglang-router launch` in front of `worker_urls`, with `engine.router`'s policy and options. Its
    Prometheus metrics go to `host:metrics_port` unless `engine.router.args` says where: the router's
    default, 0.0.0.0:29000, faces every interface, and a second router on the machine (another run's)
    dies at start on that port."""
    r = cfg.engine.router
    argv = [router_executable(), "launch", "--worker-urls", *worker_urls, "--host", host, "--port", str(port),
            "--policy", r.policy]
    if "prometheus_port" not in r.args:
        argv += ["--prometheus-port", str(metrics_port)]
    if "prometheus_host" not in r.args:
        argv += ["--prometheus-host", host]
    for name, value in r.args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *(str(v) for v in value)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv
