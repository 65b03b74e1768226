"""Placement groups per role, as bundles (pure: no Ray), and the `--ray [ADDRESS]` option's forms."""

from __future__ import annotations

import pytest

from slime_async.cli.main import optional_value
from slime_async.config import ConfigError, load_config
from slime_async.launch.placement import bundles


def test_disaggregated_layout_gives_each_role_its_own_bundles() -> None:
    cfg = load_config(None, ["engine.num_engines=2", "rollout.num_workers=3", "launch.ray.engine.gpus=2",
                             "launch.ray.rollout.cpus=0.5"])
    b = bundles(cfg)
    assert b["engine"] == [{"CPU": 1.0, "GPU": 2.0}] * 2 and b["trainer"] == [{"CPU": 1.0, "GPU": 1.0}]
    assert b["rollout"] == [{"CPU": 0.5}] * 3 and b["buffer"] == [{"CPU": 1.0}]
    assert b["router"] == [] and b["eval"] == []
    assert bundles(cfg, with_trainer=False)["trainer"] == []


def test_colocated_engines_live_in_the_trainers_bundles() -> None:
    cfg = load_config(None, ["train.backend=megatron", "train.world_size=4", "engine.num_engines=2",
                             "launch.ray.layout=colocated", "launch.ray.engine.gpus=2", "launch.ray.engine.cpus=3"])
    b = bundles(cfg)
    assert b["engine"] == []
    assert b["trainer"] == [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0},
                            {"CPU": 1.0, "GPU": 1.0}]
    too_many = load_config(None, ["train.world_size=2", "engine.num_engines=2", "launch.ray.layout=colocated",
                                  "launch.ray.engine.gpus=2"])
    with pytest.raises(ConfigError, match="need 4 GPUs, the trainer has 2"):
        bundles(too_many)


def test_attached_engines_take_no_bundles() -> None:
    cfg = load_config(None, ["engine.urls=[http://10.0.0.5:30000]", "engine.router.enabled=true"])
    assert bundles(cfg)["engine"] == [] and bundles(cfg)["router"] == [{"CPU": 1.0}]


@pytest.mark.parametrize(("argv", "expected"), [
    (["train", "c.yaml", "--ray"], ["train", "c.yaml", "--ray="]),
    (["train", "c.yaml", "--ray", "a.b=1"], ["train", "c.yaml", "--ray=", "a.b=1"]),
    (["train", "--ray", "c.yaml"], ["train", "--ray=", "c.yaml"]),
    (["train", "c.yaml", "--ray", "--resume"], ["train", "c.yaml", "--ray=", "--resume"]),
    (["train", "c.yaml", "--ray", "ray://head:10001"], ["train", "c.yaml", "--ray", "ray://head:10001"]),
    (["train", "c.yaml"], ["train", "c.yaml"]),
])
def test_ray_option_alone_or_with_an_address(argv: list[str], expected: list[str]) -> None:
    assert optional_value(argv, "--ray") == expected
