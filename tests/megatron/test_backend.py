"""The Megatron backend against the torch backend on the same model and batch (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_async.config.schema import Config, MegatronConfig, TrainConfig
from slime_async.sync import megatron_names as names
from slime_async.train.backend import Logprobs, OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.build import build_backend
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.megatron.weights import export_hf, global_names
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend


def batch_of(n: int = 6, seed: int = 0) -> Batch:
    b = build_batch(make_trajectories(n, seed=seed, vocab=300), max_seq_len=64).batch
    assert b is not None
    return b


def hf_grads(be: MegatronBackend) -> dict[str, torch.Tensor]:
    """The Megatron model's gradients in HF names and layouts."""
    out = {}
    for name, p in global_names(be.module):
        if p.grad is not None and names.exported(name, be.geometry):
            s = names.slot(name, be.geometry)
            out.update(zip(s.hf_names, names.to_hf(s, p.grad, be.geometry), strict=True))
    return out


def test_logprobs_and_entropy_equal_the_torch_backend(family_dirs: dict[str, Path]) -> None:
    batch = batch_of()
    mega = MegatronBackend(family_dirs["qwen2"], device="cpu", micro_batch_size=4)
    ref = TorchBackend(family_dirs["qwen2"], device="cpu", micro_batch_size=6)
    got, want = mega.logprobs(batch, 0.7, entropy=True), ref.logprobs(batch, 0.7, entropy=True)
    assert got.entropy is not None and want.entropy is not None
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=0)
    assert (got.logprobs[batch.attention_mask == 0] == 0).all() and (got.logprobs[:, 0] == 0).all()
    with pytest.raises(ValueError, match="reference"):
        mega.logprobs(batch, 1.0, reference=True)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_one_train_step_gives_the_torch_backends_loss_and_gradients(family: str, family_dirs: dict[str, Path]
                                                                    ) -> None:
    batch = batch_of(6)
    # an entropy bonus, so that the entropy's gradient through the vocab-parallel code is compared too
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    results, grads = [], []
    # a clip that bites: the clipped gradients are compared
    kw = dict(device="cpu", optim=OptimizerSettings(lr=1e-3, grad_clip=0.01))
    for be in (MegatronBackend(family_dirs[family], micro_batch_size=2, **kw),  # type: ignore[arg-type]
               TorchBackend(family_dirs[family], micro_batch_size=6, **kw)):  # type: ignore[arg-type]
        prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
        results.append(be.train_step(batch, obj.loss_fn(prep), 1.0, entropy=True))
        grads.append(hf_grads(be) if isinstance(be, MegatronBackend)
                     else {n: p.grad for n, p in be.model.named_parameters()})
    mega, ref = results
    assert mega.applied and ref.applied
    assert mega.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-7)
    assert mega.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5) and ref.grad_norm > 0.01
    assert mega.metrics.keys() == ref.metrics.keys()
    for k in ref.metrics:
        assert mega.metrics[k] == pytest.approx(ref.metrics[k], rel=1e-4, abs=1e-6), k
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_non_finite_step_is_skipped_and_changes_nothing(family_dirs: dict[str, Path]) -> None:
    be = MegatronBackend(family_dirs["qwen2"], device="cpu")
    before = {n: p.clone() for n, p in be.named_weights()}

    def nan_loss(mb: Batch, rows: slice, out: Logprobs) -> tuple[torch.Tensor, dict[str, float]]:
        return out.logprobs.sum() * float("nan"), {}

    result = be.train_step(batch_of(), nan_loss, 1.0)
    assert not result.applied and "non-finite" in result.reason
    assert not be.optimizer.optimizer.state  # AdamW never stepped
    for n, p in be.named_weights():
        assert torch.equal(p, before[n]), n


def test_save_and_load_restore_model_and_optimizer(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    batch = batch_of()
    obj = Objective(TrainConfig())

    def step(be: MegatronBackend) -> None:
        assert be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0).applied

    a = MegatronBackend(family_dirs["llama"], device="cpu", optim=OptimizerSettings(lr=1e-3))
    step(a)
    a.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").is_file() and (tmp_path / "ck" / "config.json").is_file()
    b = MegatronBackend(family_dirs["llama"], device="cpu", optim=OptimizerSettings(lr=1e-3))
    list(b.named_weights())  # an export planned before the load must see the loaded weights
    b.load(tmp_path / "ck")
    for be in (a, b):
        step(be)
    changed = 0
    for (n, p), (_, q), (_, r) in zip(a.named_weights(), b.named_weights(), MegatronBackend(
            family_dirs["llama"], device="cpu").named_weights(), strict=True):
        assert torch.equal(p, q), n
        changed += not torch.equal(p, r)
    assert changed > 10  # the steps did change the weights


def test_config_selects_the_megatron_backend_with_a_reference(family_dirs: dict[str, Path]) -> None:
    config = Config(train=TrainConfig(backend="megatron", kl_coef=0.1, lr=1e-2,
                                      megatron=MegatronConfig(tensor_parallel=1)))
    config.model.device = "cpu"
    be = build_backend(config, family_dirs["qwen2"])
    assert isinstance(be, MegatronBackend) and be.reference is not None
    batch = batch_of()
    start = be.logprobs(batch, 1.0).logprobs
    obj = Objective(config.train)
    ref = be.logprobs(batch, 1.0, reference=True).logprobs
    assert be.train_step(batch, obj.loss_fn(obj.prepare(batch, start, ref)), 1.0).applied
    assert torch.equal(be.logprobs(batch, 1.0, reference=True).logprobs, start)  # the reference stays
    assert not torch.equal(be.logprobs(batch, 1.0).logprobs, start)


def test_the_logits_reach_the_loss_without_a_copy(family_dirs: dict[str, Path]) -> None:
    """GPTModel turns the output layer's logits batch-first with `transpose(0, 1).contiguous()`: the
    output layer computes them batch-first already, so that the whole logits tensor (the largest of
    the step) is not copied on its way to the logprobs, and the values are the same."""
    be = MegatronBackend(family_dirs["qwen2"], device="cpu", micro_batch_size=6)
    made: list[torch.Tensor] = []
    be.module.output_layer.register_forward_hook(lambda _m, _args, out: made.append(out[0]))
    mb = batch_of()
    with torch.no_grad(), be._compat():
        logits = be._run_model(be.model, mb)
    assert logits.shape[:2] == mb.input_ids.shape and logits.is_contiguous()
    assert logits.data_ptr() == made[0].data_ptr()  # the layer's own tensor, not a copy of it
    want = TorchBackend(family_dirs["qwen2"], device="cpu", micro_batch_size=6).logprobs(mb, 1.0).logprobs
    torch.testing.assert_close(be.logprobs(mb, 1.0).logprobs, want, atol=1e-5, rtol=0)


def test_the_planned_export_follows_training_and_equals_the_general_one(family_dirs: dict[str, Path]) -> None:
    """A trainer holding the whole model exports from a plan made at its first export (views of the
    parameters): after a train step it must export the new weights, exactly as `export_hf` does."""
    be = MegatronBackend(family_dirs["qwen3"], device="cpu", optim=OptimizerSettings(lr=1e-2))
    before = {n: t.clone() for n, t in be.named_weights()}
    batch, obj = batch_of(), Objective(TrainConfig())
    assert be.train_step(batch, obj.loss_fn(obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)), 1.0).applied
    planned = list(be.named_weights())
    general = list(export_hf(be.module, be.geometry, be.layout, be.export_dtype))
    assert [n for n, _ in planned] == [n for n, _ in general] == list(before)
    for (name, got), (_, want) in zip(planned, general, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert sum(not torch.equal(before[n], t) for n, t in planned) > 10
