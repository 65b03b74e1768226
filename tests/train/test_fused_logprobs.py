"""The function both backends compile for their logprobs on a GPU (`train/fused_logprobs.py`), run
eagerly here: the same values and gradients as a log-softmax over the real vocabulary, padding dropped.
(The compiled kernels themselves run only on a GPU: `slime-async bench megatron_gpu` checks the two
backends' logprobs and train steps against each other there.)"""

from __future__ import annotations

import torch

from slime_async.train.fused_logprobs import token_logprobs


def test_the_fused_function_is_a_log_softmax_over_the_real_vocabulary() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64  # 14 padded entries with large logits: they must not count
    logits = torch.randn(2, 7, padded, generator=g) * 3
    logits[..., vocab:] = 40.0
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (2, 7), generator=g)
    for temperature in (1.0, 0.7):
        got = token_logprobs(logits, targets, temperature, vocab)
        want = torch.log_softmax(logits[..., :vocab] / temperature, -1).gather(-1, targets[..., None])[..., 0]
        torch.testing.assert_close(got, want)
        (grad_got,) = torch.autograd.grad(got.sum(), logits)
        (grad_want,) = torch.autograd.grad(want.sum(), logits)
        torch.testing.assert_close(grad_got, grad_want)
        assert grad_got[..., vocab:].abs().max() == 0  # padded entries get no gradient
