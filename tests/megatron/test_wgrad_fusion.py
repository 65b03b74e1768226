"""The stand-in for Apex's `fused_weight_gradient_mlp_cuda` (`train/megatron/wgrad_fusion.py`), called by
Megatron's own linear layer backward, as on a GPU with gradient-accumulation fusion on (here on CPU,
float32: the same call order and arguments; the bf16 -> float32 GEMM itself runs on a GPU only, and
`slime-async bench megatron_gpu` compares a fused train step with an unfused one there)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import layers

from slime_async.train.megatron import wgrad_fusion
from slime_async.train.megatron.cpu_compat import cpu_megatron


@pytest.mark.parametrize("tied", [False, True])
def test_megatrons_backward_accumulates_into_main_grad_through_the_stand_in(monkeypatch: pytest.MonkeyPatch,
                                                                             tied: bool) -> None:
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", wgrad_fusion.APEX_FUNCTIONS, raising=False)
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    weight.main_grad = torch.randn(5, 3, generator=g)  # what earlier micro-batches left there
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = tied  # Megatron's flag for a weight shared with the embedding
    start = weight.main_grad.clone()
    x = torch.randn(4, 2, 3, generator=g, requires_grad=True)  # [s, b, in]
    with cpu_megatron():
        y = layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, True, False, False)
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
    want = start + dy.reshape(-1, 5).t() @ x.detach().reshape(-1, 3)
    torch.testing.assert_close(weight.main_grad, want)
    assert weight.grad_added_to_main_grad  # DDP's hook then adds nothing more (or, tied, only zeros)
    assert weight.grad is not None and (not tied or not weight.grad.any())
    torch.testing.assert_close(x.grad, dy @ weight.detach())


def test_the_fusion_is_enabled_only_where_its_gemm_was_checked() -> None:
    assert not wgrad_fusion.works_on("cpu") and not wgrad_fusion.enable("cpu")
