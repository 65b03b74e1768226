"""Config loading: YAML, overrides, defaults, and the message of every kind of bad input."""

from __future__ import annotations

import importlib
from pathlib import Path

import msgspec
import pytest

from slime_async.config import Config, ConfigError, load_config, parse_override, to_yaml

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_shipped_configs_load() -> None:
    assert load_config() == Config()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config), path


def test_yaml_values_and_overrides_apply(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n  sampling:\n    temperature: 0.7\ntrain:\n  lr: 3.0e-5\n")
    cfg = load_config(
        path,
        ["rollout.group_size=16", "rollout.sampling.top_p=0.9", "engine.urls=[http://a:1, http://b:2]", "run.name=123"],
    )
    assert cfg.rollout.group_size == 16  # the override wins over the file
    assert cfg.rollout.sampling.temperature == 0.7  # the file wins over the default
    assert cfg.rollout.sampling.top_p == 0.9
    assert cfg.train.lr == 3.0e-5
    assert cfg.engine.urls == ["http://a:1", "http://b:2"]
    assert cfg.run.name == "123"  # a string field keeps the text, not YAML's int
    assert cfg.rollout.batch_size == Config().rollout.batch_size  # untouched default


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""), ["rollout.max_staleness=0", "buffer.group_timeout_s=2.5"])
    (tmp_path / "elsewhere").mkdir()
    again = load_config(write(tmp_path / "elsewhere", to_yaml(cfg)))
    assert again == cfg  # run.python_path was made absolute: the same directories from anywhere


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""))
    assert cfg.run.python_path == [str(tmp_path.resolve())]  # the config file's own directory
    assert msgspec.structs.replace(cfg, run=Config().run) == Config()


def test_python_path_is_relative_to_the_config_file_and_importable(tmp_path: Path) -> None:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "pp_probe_module.py").write_text("VALUE = 7\n")
    cfg = load_config(write(tmp_path, "run:\n  python_path: [mods]\n"))
    assert cfg.run.python_path == [str((tmp_path / "mods").resolve())]
    assert importlib.import_module("pp_probe_module").VALUE == 7


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        # unknown keys, with a hint when one is close
        ("model:\n  pathh: x\n", [], "c.yaml: model.pathh: unknown key; did you mean 'path'? (model takes: path,"),
        ("modle: {}\n", [], "c.yaml: modle: unknown key; did you mean 'model'? (the top level takes: run, model"),
        ("", ["rollout.sampling.temprature=1"], "override rollout.sampling.temprature=1: "
         "rollout.sampling.temprature: unknown key; did you mean 'temperature'?"),
        ("", ["rollout.zzz=1"], "rollout.zzz: unknown key (rollout takes: group_size,"),
        # wrong types and values: the path, the value, what is allowed
        ("rollout:\n  group_size: many\n", [], "c.yaml: rollout.group_size: got 'many'; expected int"),
        ("", ["rollout.group_size=0"], "override rollout.group_size=0: rollout.group_size: got 0; expected int >= 1"),
        ("", ["train.backend=jax"], "train.backend: got 'jax'; expected one of 'torch', 'megatron'"),
        ("", ["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p: got 1.5; expected float <= 1.0"),
        ("", ["rollout.sampling.temperature=-1"], "temperature: got -1; expected float >= 0.0"),
        ("", ["engine.urls=[1]"], "engine.urls[0]: got 1; expected str"),
        ("", ["engine.urls=http://a"], "engine.urls: got 'http://a'; expected a list"),
        ("", ["engine.port=70000"], "engine.port: got 70000; expected int <= 65535"),
        ("run: 3\n", [], "c.yaml: run: got 3; expected a mapping"),
        ("", ["train.grad_clip=yes"], "train.grad_clip: got True; expected float"),
        # malformed files and overrides
        ("run:\n  name: x\n model: 3\n", [], "c.yaml:3:2: invalid YAML: expected <block end>"),
        ("- a\n- b\n", [], "c.yaml: expected a mapping of sections (run:, model:, ...), got list"),
        ("", ["rollout.group_size"], "override 'rollout.group_size': expected key.sub=value"),
        ("", ["=3"], "override '=3': expected key.sub=value"),
        ("", ["engine.urls=[a, b"], "override 'engine.urls=[a, b': the value is not valid YAML"),
        ("run:\n  name: x\n", ["run.name.first=x"], "override run.name.first=x: run.name is a string, not a section"),
        ("", ["run.name.first=x"], "override run.name.first=x: run.name: got {'first': 'x'}; expected str"),
    ],
)
def test_errors_name_the_place_the_value_and_what_is_allowed(
    tmp_path: Path, text: str, overrides: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)  # one line


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_parse_override_values() -> None:
    assert parse_override("a.b=3") == (("a", "b"), 3)
    assert parse_override("a=0.5") == (("a",), 0.5)
    assert parse_override("a=true") == (("a",), True)
    assert parse_override("a=[1, 2]") == (("a",), [1, 2])
    assert parse_override("a=x=y") == (("a",), "x=y")
    assert parse_override("a=") == (("a",), "")


def test_exponent_floats_without_a_dot_are_floats_in_files_and_overrides(tmp_path: Path) -> None:
    # YAML 1.1 reads `1e-4` as a string; a learning rate written that way must still work
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n")
    cfg = load_config(path, ["warmstart.lr=2E-3", "run.name=1e5x"])
    assert cfg.train.lr == 3e-4 and cfg.warmstart.lr == 2e-3 and cfg.run.name == "1e5x"
