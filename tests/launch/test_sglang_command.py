"""The `sglang:` section and the SGLang command builder, against SGLang 0.5.23's own definition.

Three checks: the checked-in extract (`config/sglang_server_args.json`) equals a fresh extraction
from SGLang's wheel; every flag our builder writes parses, to the intended value, with the parser
that SGLang's own code builds from its ServerArgs namespaces; a config's `sglang:` section becomes
the command a user would type. The wheel comes from PyPI (`pip download --no-deps`, cached), as in
tests/engine/test_conformance.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from sglang_wheel import sglang_parser

from slime_async.config import ConfigError, load_config
from slime_async.config.sglang import LAUNCHER_OWNED, SPEC_PATH, server_args_spec
from slime_async.config.sglang_extract import SGLANG_VERSION, cached_wheel, extract, read_sources
from slime_async.launch.sglang_command import flag_args, router_argv, sglang_argv


@pytest.fixture(scope="module")
def wheel() -> Path:
    path = cached_wheel(SGLANG_VERSION)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def parser(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> argparse.ArgumentParser:
    return sglang_parser(wheel, tmp_path_factory.mktemp("sglang-src"))


def test_checked_in_extract_is_sglangs_definition(wheel: Path) -> None:
    fresh = extract(read_sources(wheel))
    checked_in = json.loads(SPEC_PATH.read_text())
    assert checked_in["sglang_version"] == SGLANG_VERSION
    assert fresh == checked_in["fields"], "regenerate: python -m slime_async.config.sglang_extract"
    assert len(fresh) > 400 and fresh["tp_size"]["aliases"] == ["--tensor-parallel-size"]


def sample(entry: dict[str, Any]) -> tuple[Any, Any]:
    """A config value for a field of this kind, and what SGLang's parser must make of it."""
    kind, choices = entry["kind"], entry["choices"]
    if isinstance(choices, list) and choices:
        return choices[-1], choices[-1]
    if kind == "bool":
        return True, True
    if kind == "bool_optional":
        return False, False
    if kind == "int":
        return 7, 7
    if kind == "float":
        return 0.25, 0.25
    if kind == "list":
        values = [3, 4] if entry["item"] == "int" else [0.5] if entry["item"] == "float" else ["a", "b"]
        return values, values
    if kind == "json":  # json.loads is SGLang's real parser; json_list_type is a placeholder here
        return {"k": [1]}, {"k": [1]} if entry["type_parser"] == "json.loads" else json.dumps({"k": [1]})
    return "x", "x"


def test_every_flag_parses_to_its_value_with_sglangs_own_parser(parser: argparse.ArgumentParser) -> None:
    spec = server_args_spec()
    known = {s for action in parser._actions for s in action.option_strings}
    manual = {name for name, entry in spec.items() if entry.get("manual")}
    assert {"sampling_backend", "tool_call_parser"} <= manual
    checked = 0
    for name, entry in spec.items():
        if entry["flag"] is None or name in manual:
            continue  # no flag, or registered by hand in ServerArgs.add_cli_args (read by the extractor)
        assert entry["flag"] in known, f"{name}: SGLang has no flag {entry['flag']}"
        assert set(entry["aliases"]) <= known, name
        if entry["kind"].startswith("action:"):
            continue
        value, expected = sample(entry)
        base = [] if name == "model_path" else ["--model-path", "m"]
        parsed = parser.parse_args([*base, *flag_args(name, value)])
        assert getattr(parsed, name) == expected, f"{name}: {flag_args(name, value)} -> {getattr(parsed, name)!r}"
        checked += 1
    assert checked > 400


def test_config_section_becomes_the_server_command(parser: argparse.ArgumentParser) -> None:
    cfg = load_config(None, [
        "engine.kind=sglang", "engine.admin_token=secret", "run.seed=5", "model.dtype=bfloat16",
        "sglang.tp_size=2", "sglang.mem_fraction_static=0.7", "sglang.enable_torch_compile=true",
        "sglang.enable_tf32_matmul=false", "sglang.context_length=32k", "sglang.cuda_graph_bs_decode=[1, 2, 4]",
        "sglang.attention_backend=fa3", """sglang.json_model_override_args='{"rope_theta": 1000000}'""",
    ])
    argv = sglang_argv(cfg, model_path="/models/qwen", host="10.0.0.2", port=31000, index=1, weight_version="0",
                       release_memory=True, python="python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    ns = parser.parse_args(argv[3:])
    assert (ns.model_path, ns.host, ns.port, ns.random_seed, ns.weight_version, ns.admin_api_key) == (
        "/models/qwen", "10.0.0.2", 31000, 6, "0", "secret")
    assert (ns.tp_size, ns.mem_fraction_static, ns.enable_torch_compile, ns.enable_tf32_matmul) == (2, 0.7, True, False)
    assert ns.context_length == "32k" and ns.cuda_graph_bs_decode == [1, 2, 4] and ns.attention_backend == "fa3"
    assert json.loads(ns.json_model_override_args) == {"rope_theta": 1000000}
    assert ns.enable_memory_saver is True and ns.dtype == "bfloat16"


@pytest.mark.parametrize(("override", "message"), [
    ("sglang.tp_sise=2", "did you mean 'tp_size'"),
    ("sglang.port=1", "port: set by slime_async from engine.port"),
    ("sglang.dtype=fp9", "expected one of 'auto', 'half'"),
    ("sglang.tp_size=two", "sglang.tp_size: got 'two'; expected int"),
])
def test_bad_sglang_fields_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_launcher_owned_fields_are_serverargs_fields() -> None:
    assert set(LAUNCHER_OWNED) <= set(server_args_spec())


def test_router_command() -> None:
    cfg = load_config(None, ["engine.router.enabled=true", "engine.router.policy=round_robin",
                             "engine.router.args={health_check_interval_secs: 1, disable_retries: true}"])
    argv = router_argv(cfg, ["http://a:1", "http://b:2"], "127.0.0.1", 8000, 8001)
    assert argv[1:] == ["launch", "--worker-urls", "http://a:1", "http://b:2", "--host", "127.0.0.1", "--port",
                        "8000", "--policy", "round_robin", "--prometheus-port", "8001", "--prometheus-host",
                        "127.0.0.1", "--health-check-interval-secs", "1", "--disable-retries"]
    # where the config says where its metrics go, that stands
    own = load_config(None, ["engine.router.args={prometheus_port: 9100, prometheus_host: 0.0.0.0}"])
    argv = router_argv(own, ["http://a:1"], "127.0.0.1", 8000, 8001)
    assert argv[-4:] == ["--prometheus-port", "9100", "--prometheus-host", "0.0.0.0"] and "8001" not in argv


@pytest.mark.parametrize(("which", "replay", "expected"), [
    ("tiny_moe_dir", "true", True), ("tiny_moe_dir", "false", False), ("tiny_model_dir", "true", False)])
def test_an_moe_model_with_routing_replay_gets_sglangs_routed_experts_switch(
        which: str, replay: str, expected: bool, request: pytest.FixtureRequest, parser: argparse.ArgumentParser
) -> None:
    cfg = load_config(None, ["engine.kind=sglang", f"train.moe.routing_replay={replay}"])
    argv = sglang_argv(cfg, model_path=str(request.getfixturevalue(which)), host="h", port=1, index=0,
                       weight_version="0", python="python")
    assert parser.parse_args(argv[3:]).enable_return_routed_experts is expected
