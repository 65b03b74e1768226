"""The torch backend on the real tiny model: logprobs, accumulation, skipped steps, weights, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_async.config.model_dir import check_model_dir
from slime_async.config.schema import TrainConfig
from slime_async.train.backend import Logprobs, OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend


def backend(model_dir: Path, **kw: object) -> TorchBackend:
    return TorchBackend(model_dir, device="cpu", **kw)  # type: ignore[arg-type]


def batch_of(n: int = 6, seed: int = 0) -> Batch:
    b = build_batch(make_trajectories(n, seed=seed), max_seq_len=64).batch
    assert b is not None
    return b


def test_logprobs_match_unpadded_forward_at_temperature(tiny_model_dir: Path) -> None:
    be = backend(tiny_model_dir, micro_batch_size=4)
    batch = batch_of()
    out = be.logprobs(batch, temperature=0.7, entropy=True)
    assert out.entropy is not None
    for i in range(len(batch)):
        k = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :k]
        with torch.no_grad():
            logits = be.model(input_ids=ids[None]).logits[0].float() / 0.7
        lp = torch.log_softmax(logits, -1)
        want = torch.cat([torch.zeros(1), lp[:-1].gather(1, ids[1:, None])[:, 0]])
        torch.testing.assert_close(out.logprobs[i, :k], want, atol=1e-5, rtol=0)
        ent = -(lp.exp() * lp).sum(-1)[:-1]
        torch.testing.assert_close(out.entropy[i, 1:k], ent, atol=1e-5, rtol=0)
        assert out.logprobs[i, k:].abs().sum() == 0  # padding is 0
    with pytest.raises(ValueError, match="temperature"):
        be.logprobs(batch, temperature=0.0)
    with pytest.raises(ValueError, match="reference"):
        be.logprobs(batch, 1.0, reference=True)


def _one_step(model_dir: Path, micro: int, batch: Batch) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    be = backend(model_dir, micro_batch_size=micro, optim=OptimizerSettings(lr=1e-3))
    obj = Objective(TrainConfig(loss="grpo"))
    prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
    result = be.train_step(batch, obj.loss_fn(prep), 1.0)
    assert result.applied and result.grad_norm > 0
    # gradients, not updated weights: Adam's normalisation turns rounding in near-zero gradients
    # into full-size updates of either sign
    return {n: p.grad.detach().clone() for n, p in be.model.named_parameters() if p.grad is not None}


def test_gradient_accumulation_equals_one_big_micro_batch(tiny_model_dir: Path) -> None:
    batch = batch_of(6)
    small, big = _one_step(tiny_model_dir, 2, batch), _one_step(tiny_model_dir, 6, batch)
    for name in small:
        torch.testing.assert_close(small[name], big[name], atol=1e-7, rtol=1e-4)
    assert len(small) > 10


def test_non_finite_step_is_skipped_and_changes_nothing(tiny_model_dir: Path) -> None:
    be = backend(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in be.named_weights()}

    def nan_loss(mb: Batch, rows: slice, out: Logprobs) -> tuple[torch.Tensor, dict[str, float]]:
        return out.logprobs.sum() * float("nan"), {}

    result = be.train_step(batch_of(), nan_loss, 1.0)
    assert not result.applied and "non-finite" in result.reason
    assert not be.optimizer.state  # AdamW never stepped
    for n, p in be.named_weights():
        assert torch.equal(p, before[n])


def test_named_weights_are_hf_names_each_once(tiny_model_dir: Path) -> None:
    be = backend(tiny_model_dir)
    names = [n for n, _ in be.named_weights()]
    assert len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert set(names) <= {n for n, _ in be.model.named_parameters(remove_duplicate=False)}


def test_save_and_load_restore_model_and_optimizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = batch_of()
    obj = Objective(TrainConfig())
    a = backend(tiny_model_dir, optim=OptimizerSettings(lr=1e-3))
    a.train_step(batch, obj.loss_fn(obj.prepare(batch, a.logprobs(batch, 1.0).logprobs)), 1.0)
    a.save(tmp_path / "ck")
    check_model_dir(tmp_path / "ck")  # a whole model directory, tokenizer and chat template included
    b = backend(tiny_model_dir, optim=OptimizerSettings(lr=1e-3))
    b.load(tmp_path / "ck")
    for be in (a, b):
        be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0)
    for (n, p), (_, q) in zip(a.named_weights(), b.named_weights(), strict=True):
        assert torch.equal(p, q), n


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.path"):
        backend(tmp_path / "nothing")


def test_bfloat16_is_mixed_precision(tiny_model_dir: Path) -> None:
    be = backend(tiny_model_dir, dtype="bfloat16")
    fp32 = backend(tiny_model_dir)
    batch = batch_of(2)
    assert all(p.dtype == torch.float32 for p in be.model.parameters())  # master weights
    assert {t.dtype for _, t in be.named_weights()} == {torch.bfloat16}  # what engines receive
    low, high = be.logprobs(batch, 1.0).logprobs, fp32.logprobs(batch, 1.0).logprobs
    m = batch.loss_mask.bool()
    assert 0 < (low[m] - high[m]).abs().max() < 0.1  # bf16 rounding, not another model


def test_lr_warmup_ramps_linearly_and_survives_save_and_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    be = backend(tiny_model_dir, optim=OptimizerSettings(lr=1e-3), warmup_steps=4)
    obj = Objective(TrainConfig(loss="grpo"))
    batch = batch_of()
    lrs = []
    for _ in range(3):
        prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
        assert be.train_step(batch, obj.loss_fn(prep), 1.0).applied
        lrs.append(be.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4])
    be.save(tmp_path / "ckpt")
    again = backend(tiny_model_dir, optim=OptimizerSettings(lr=1e-3), warmup_steps=4)
    again.load(tmp_path / "ckpt")
    assert again.optimizer_steps() == 3
    for _ in range(2):
        prep = obj.prepare(batch, again.logprobs(batch, 1.0).logprobs)
        again.train_step(batch, obj.loss_fn(prep), 1.0)
        lrs.append(again.optimizer.param_groups[0]["lr"])
    assert lrs[3:] == pytest.approx([1e-3, 1e-3])  # the ramp went on from step 4, not from 1


def test_the_gpu_logprob_path_gives_the_plain_one_s_logprobs_and_step(tiny_model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the backend takes its logprobs from the whole logits through the compiled function
    (`train/fused_logprobs.py`); here that path runs with the same function uncompiled (compiling
    needs a GPU or a C++ toolchain): the same logprobs, loss and gradient norm as the plain path."""
    from slime_async.train import fused_logprobs as fused
    from slime_async.train import torch_backend

    calls: list[tuple[int, ...]] = []

    def eager(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab: int) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return fused.token_logprobs(logits, targets, temperature, vocab)

    monkeypatch.setattr(torch_backend, "fused_logprobs", eager)
    batch, obj = batch_of(), Objective(TrainConfig())
    results = []
    for on in (True, False):
        be = backend(tiny_model_dir, micro_batch_size=3)
        be.fused_logprobs = on
        lp = be.logprobs(batch, 0.8).logprobs
        step = be.train_step(batch, obj.loss_fn(obj.prepare(batch, lp)), 0.8)
        results.append((lp, step.loss, step.grad_norm))
    assert len(calls) == 4 and calls[0][:2] == tuple(batch.input_ids[:3].shape)  # 2 micro-batches, 2 passes
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    # the loss is a difference of means near 0 (-6.7e-5): relative precision alone is too strict for it
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-6, abs=1e-9)
    assert results[0][2] == pytest.approx(results[1][2], rel=1e-5)
