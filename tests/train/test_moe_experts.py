"""`moe.experts`: the grouped expert matmuls shared by the Megatron backend and the engine, against
one plain matmul per expert; the per-expert fallback against the grouped kernel (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_async.moe import experts as ex


def routed(tokens: int = 40, k: int = 2, num_experts: int = 6, seed: int = 0) -> torch.Tensor:
    """[tokens x k] expert ids, k distinct per token, the last expert never chosen (an empty group)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, num_experts - 1, generator=g).argsort(dim=-1)[:, :k].reshape(-1)


def test_group_ends_sort_rows_by_expert_and_count_them_on_the_device() -> None:
    ids = routed()
    order, offs = ex.group_ends(ids, 6)
    assert offs.dtype == torch.int32 and offs.tolist() == torch.bincount(ids, minlength=6).cumsum(0).tolist()
    assert (ids[order][1:] >= ids[order][:-1]).all() and offs[-1] == offs[-2] == len(ids)
    for e in range(6):  # token order kept within an expert
        assert (order[ids[order] == e].diff() > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_experts_equal_one_matmul_per_expert(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    ids = routed()
    order, offs = ex.group_ends(ids, 6)
    rows = torch.randn(len(ids), 32, generator=g).to(dtype)[order]
    gate_up, down = torch.randn(6, 48, 32, generator=g).to(dtype), torch.randn(6, 32, 24, generator=g).to(dtype)
    scale = torch.rand(len(ids), generator=g).to(dtype)
    got = ex.swiglu_experts(rows, offs, gate_up, down, F.silu, scale=scale)
    want = torch.empty_like(got)
    e_of = ids[order]
    for e in range(6):
        sel = e_of == e
        gate, up = F.linear(rows[sel], gate_up[e]).chunk(2, dim=-1)
        want[sel] = F.linear((F.silu(gate) * up * scale[sel, None]).to(dtype), down[e])
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(got, want, **tol)


def test_the_fallback_equals_the_grouped_kernel_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(2)
    ids = routed()
    _, offs = ex.group_ends(ids, 6)
    x = torch.randn(len(ids), 32, generator=g)
    w = torch.randn(6, 16, 32, generator=g)
    grad = torch.randn(len(ids), 16, generator=g)
    outs = []
    for fn in (torch._grouped_mm, ex.looped_mm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi.transpose(1, 2), offs=offs) if fn is torch._grouped_mm else fn(xi, wi.transpose(1, 2), offs)
        out.backward(grad)
        outs.append((out.detach(), xi.grad, wi.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_dtype_the_kernel_refuses_falls_back_to_the_same_values() -> None:
    """float64: `torch._grouped_mm` refuses it, `grouped_mm` computes it with one matmul per expert."""
    g = torch.Generator().manual_seed(3)
    ids = routed()
    order, offs = ex.group_ends(ids, 6)
    x, w = torch.randn(len(ids), 32, generator=g, dtype=torch.float64), torch.randn(6, 32, 16, generator=g,
                                                                                      dtype=torch.float64)
    assert not ex.can_group(x, w) and ex.can_group(x.float(), w.float())
    e_of = ids[order]
    want = torch.stack([x[i] @ w[e_of[i]] for i in range(len(x))])
    torch.testing.assert_close(ex.grouped_mm(x, w, offs), want, atol=1e-12, rtol=0)


def test_the_kernel_probe_is_not_fooled_by_its_first_callers_mode() -> None:
    """The engine's first call comes under inference mode, where no backward runs: the probe (cached
    per device, dtype and shape) must still find the kernel, or every later caller would loop."""
    ex._probe.cache_clear()
    with torch.inference_mode():
        assert ex.can_group(torch.zeros(4, 48), torch.zeros(3, 24, 48).transpose(1, 2))
    with torch.no_grad():
        assert ex.can_group(torch.zeros(4, 40), torch.zeros(3, 24, 40).transpose(1, 2))


def test_a_weight_off_a_16_byte_boundary_takes_the_fallback_with_the_same_values() -> None:
    """A stacked weight inside a flat buffer (as DDP lays parameters out) may start 4 bytes in."""
    g = torch.Generator().manual_seed(4)
    ids = routed()
    _, offs = ex.group_ends(ids, 6)
    x = torch.randn(len(ids), 32, generator=g)
    flat = torch.randn(1 + 6 * 16 * 32, generator=g)
    w = flat[1:].view(6, 16, 32).transpose(1, 2)
    assert not ex.can_group(x, w)
    torch.testing.assert_close(ex.grouped_mm(x, w, offs), torch._grouped_mm(x, w.contiguous(), offs=offs), atol=1e-5,
                               rtol=1e-5)
