"""`copy_in_place` and `InPlaceCopier`: every tensor lands exactly, by whichever copy its size and device
choose; a bad update changes nothing, also one that looks like the last good one."""

from __future__ import annotations

import pytest
import torch

import slime_async.engine.weights as weights
from slime_async.engine.weights import InPlaceCopier, copy_in_place, copy_on_device

SHAPES = {"embed": (300, 64), "q": (64, 64), "bias": (64,), "norm": (64,)}
"""Sizes around the thresholds the tests set: one large matrix, the rest small."""


def params_and_update(device: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.zeros(s, dtype=torch.bfloat16).to(device) for n, s in SHAPES.items()}
    # float32, as a trainer sends them: the copy converts to the model's bf16
    update = {n: torch.randn(s, generator=g).to(device) for n, s in SHAPES.items()}
    return params, update


def assert_landed(params: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> None:
    for name, tensor in update.items():
        assert torch.equal(params[name], tensor.to(torch.bfloat16)), name


def test_copy_on_device_copies_the_large_and_the_rest() -> None:
    params, update = params_and_update("cpu")
    large = ["embed"]
    rest = [n for n in SHAPES if n not in large]
    copy_on_device(([params[n] for n in large], [update[n] for n in large]),
                   ([params[n] for n in rest], [update[n] for n in rest]))
    assert_landed(params, update)


@pytest.mark.parametrize("threshold", [1, 1000, 10**9])  # all large, a mix, none large
def test_copy_in_place_on_cpu_at_any_split(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr(weights, "SMALL_COPY_ELEMENTS", threshold)
    params, update = params_and_update("cpu")
    copy_in_place(params, update)
    assert_landed(params, update)


def test_an_empty_update_is_no_error() -> None:
    params, _ = params_and_update("cpu")
    copy_in_place(params, {})
    assert all(not p.any() for p in params.values())


def test_a_bad_tensor_after_good_ones_changes_nothing() -> None:
    params, update = params_and_update("cpu")
    update["norm"] = torch.zeros(65)  # last: the checks must all run before the first copy
    with pytest.raises(ValueError, match=r"'norm' has shape \(65,\), the model's is \(64,\)"):
        copy_in_place(params, update)
    assert all(not p.any() for p in params.values())


def test_the_copier_reuses_its_plan_for_the_same_update() -> None:
    params, update = params_and_update("cpu")
    copier = InPlaceCopier(params)
    copier(update)
    plan = copier._plan
    again = {n: t * 2 for n, t in update.items()}
    copier(again)
    assert copier._plan is plan
    assert_landed(params, again)
    copier({"q": update["q"]})  # other names: a new plan
    assert copier._plan is not plan and torch.equal(params["q"], update["q"].to(torch.bfloat16))


@pytest.mark.parametrize(("bad", "message"), [
    (torch.zeros(65), r"'norm' has shape \(65,\), the model's is \(64,\)"),
    (torch.zeros(64, dtype=torch.int64), r"'norm' has dtype torch.int64, expected a floating point tensor"),
])
def test_the_copier_checks_an_update_like_the_last_one(bad: torch.Tensor, message: str) -> None:
    params, update = params_and_update("cpu")
    copier = InPlaceCopier(params)
    copier(update)
    before = {n: p.clone() for n, p in params.items()}
    with pytest.raises(ValueError, match=message):
        copier({**{n: t * 2 for n, t in update.items()}, "norm": bad})  # same names, one bad tensor
    assert all(torch.equal(params[n], before[n]) for n in params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("threshold", [1, 1000, 10**9])
def test_copy_in_place_on_a_gpu_at_any_split(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr(weights, "LARGE_DEVICE_COPY_ELEMENTS", threshold)
    params, update = params_and_update("cuda")
    copy_in_place(params, update)
    torch.cuda.synchronize()
    assert_landed(params, update)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_copier_follows_parameters_moved_off_the_gpu() -> None:
    params, update = params_and_update("cuda")
    params = {n: torch.nn.Parameter(p, requires_grad=False) for n, p in params.items()}
    copier = InPlaceCopier(params)
    copier(update)
    for p in params.values():  # as the engine's release_memory does: same Parameter, its data moved
        p.data = p.data.cpu()
    cpu_update = {n: t.cpu() * 2 for n, t in update.items()}
    copier(cpu_update)
    assert not copier._plan.on_device  # type: ignore[union-attr]
    assert_landed(params, cpu_update)
