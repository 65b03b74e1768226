"""`copy_in_place`: every tensor lands exactly, by whichever copy its size and device choose."""

from __future__ import annotations

import pytest
import torch

import slime_async.engine.weights as weights
from slime_async.engine.weights import copy_in_place, copy_on_device

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("threshold", [1, 1000, 10**9])
def test_copy_in_place_on_a_gpu_at_any_split(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr(weights, "LARGE_DEVICE_COPY_ELEMENTS", threshold)
    params, update = params_and_update("cuda")
    copy_in_place(params, update)
    torch.cuda.synchronize()
    assert_landed(params, update)
