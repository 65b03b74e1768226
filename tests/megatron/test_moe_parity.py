"""The Megatron backend on a Qwen3-MoE model (CPU, fp32) against transformers and the torch backend.

The tiny-moe preset with every weight made random (norms and router too: a swapped norm or a router
that routes evenly would otherwise go unseen): logits and logprobs, the HF -> Megatron -> HF round
trip, one train step, routing replay against transformers' forward with the same experts forced,
the router losses against their definition on transformers' router logits, and two gloo processes
(expert, tensor and both) against one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import wait_all
from safetensors import safe_open
from test_backend import hf_grads
from transformers import AutoModelForCausalLM

from slime_async.config.schema import MegatronConfig, MoeConfig, TrainConfig
from slime_async.models.tiny_model import cached_model_dir
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.megatron.backend import MegatronBackend
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend

LAYERS, K, EXPERTS = 4, 2, 8
NO_AUX = MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.0)
WORKER = Path(__file__).with_name("moe_parallel_worker.py")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe-random")
    model = AutoModelForCausalLM.from_pretrained(cached_model_dir("tiny-moe"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            # norms around 1; routers sharp enough that top-k choices are clear-cut; the rest small
            # enough that logits stay near those of a trained model (large ones only magnify rounding)
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            p.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mega(moe_dir: Path) -> MegatronBackend:
    return MegatronBackend(moe_dir, device="cpu", micro_batch_size=4, moe=NO_AUX)


def batch_of(n: int = 6, seed: int = 0) -> Batch:
    b = build_batch(make_trajectories(n, seed=seed, vocab=882), max_seq_len=64).batch
    assert b is not None
    return b


def own_routes(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[N, T, layers x k] the experts transformers' model picks for every token."""
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    ids = [torch.topk(torch.softmax(lg.float(), -1), K, dim=-1).indices for lg in out.router_logits]
    n, t = batch.input_ids.shape
    return torch.cat([i.reshape(n, t, K) for i in ids], dim=-1)


def forced_logprobs(model: torch.nn.Module, batch: Batch, routes: torch.Tensor) -> torch.Tensor:
    """transformers' forward with each token's experts taken from `routes` (-1: its own top-k), the
    weights renormalised softmax probs at those experts, as the contract defines replay."""
    n, t = batch.input_ids.shape
    patches = []
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate
        rec = routes[:, :, layer * K:(layer + 1) * K].reshape(n * t, K).long()

        def forward(h: torch.Tensor, gate: torch.nn.Module = gate, rec: torch.Tensor = rec) -> tuple:
            logits = F.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            ids = torch.where((rec >= 0).all(-1, keepdim=True), rec, torch.topk(probs, K, dim=-1).indices)
            w = probs.gather(1, ids)
            return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids

        patches.append(mock.patch.object(gate, "forward", forward))
    for p in patches:
        p.start()
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    finally:
        for p in patches:
            p.stop()
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(n, 1), lp], dim=1) * batch.attention_mask


def test_logprobs_equal_the_torch_backend_and_export_is_the_checkpoint(moe_dir: Path, mega: MegatronBackend
                                                                        ) -> None:
    batch = batch_of()
    ref = TorchBackend(moe_dir, device="cpu", micro_batch_size=6)
    got, want = mega.logprobs(batch, 0.7, entropy=True), ref.logprobs(batch, 0.7, entropy=True)
    assert got.entropy is not None and want.entropy is not None
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=0)

    with safe_open(moe_dir / "model.safetensors", framework="pt") as f:
        ckpt = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    exported = list(mega.named_weights())
    names = [n for n, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(ckpt)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in ckpt and "model.layers.0.mlp.gate.weight" in ckpt
    for name, tensor in exported:
        assert torch.equal(tensor, ckpt[name]), name


def test_replay_routes_recorded_tokens_to_their_experts(moe_dir: Path, mega: MegatronBackend) -> None:
    batch = batch_of()
    hf = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    own = own_routes(hf, batch)
    forced = (own + 1) % EXPERTS  # other experts for every token and layer, still k distinct ones
    forced[:, ::3] = -1  # every third position unreported: the model routes it itself
    plain = mega.logprobs(batch, 1.0).logprobs
    replayed = mega.logprobs(batch_with(batch, forced), 1.0).logprobs
    own_replayed = mega.logprobs(batch_with(batch, own), 1.0).logprobs
    real = batch.attention_mask.bool()
    assert (replayed - plain)[real].abs().max() > 0.05  # the forced experts change the outputs
    torch.testing.assert_close(replayed, forced_logprobs(hf, batch, forced), atol=1e-5, rtol=0)
    torch.testing.assert_close(own_replayed, plain, atol=1e-5, rtol=0)  # replaying its own choice: no change
    off = MegatronBackend(moe_dir, device="cpu", micro_batch_size=4, moe=MoeConfig(routing_replay=False))
    torch.testing.assert_close(off.logprobs(batch_with(batch, forced), 1.0).logprobs, plain, atol=1e-5, rtol=0)


def batch_with(batch: Batch, routes: torch.Tensor) -> Batch:
    import dataclasses

    return dataclasses.replace(batch, routed_experts=routes.to(torch.int16))


@pytest.mark.parametrize("case", ["plain", "losses_and_replay"])
def test_one_train_step_equals_the_torch_backends(case: str, moe_dir: Path) -> None:
    """Loss, metrics, gradient norm and the weights after the step (micro-batches of 2 rows in both:
    the router losses are per micro-batch). With router losses and a replayed record (other experts
    than the model's own, some tokens unreported) their gradients and the replay's are compared too."""
    batch = batch_of(6)
    moe = NO_AUX
    if case == "losses_and_replay":
        moe = MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02)
        forced = (own_routes(AutoModelForCausalLM.from_pretrained(moe_dir), batch) + 3) % EXPERTS
        forced[:, 1::4] = -1
        batch = batch_with(batch, forced)
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    # a clip that bites; Adam's eps well above the rounding of the smallest gradients (at 1e-8 the first
    # step's lr x g / (|g| + eps) turns a 1e-10 difference of a 1e-8 gradient into 1% of lr)
    kw = dict(device="cpu", optim=OptimizerSettings(lr=1e-3, eps=1e-6, grad_clip=0.01), micro_batch_size=2, moe=moe)
    results, weights = [], []
    mega_be, torch_be = MegatronBackend(moe_dir, **kw), TorchBackend(moe_dir, **kw)  # type: ignore[arg-type]
    for be in (mega_be, torch_be):
        prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
        results.append(be.train_step(batch, obj.loss_fn(prep), 1.0, entropy=True))
        weights.append(dict(be.named_weights()))
    mega, ref = results
    want_grads = checkpoint_grads(torch_be.model)
    got_grads = hf_grads(mega_be)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert mega.applied and ref.applied
    assert mega.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-7)
    assert mega.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5) and ref.grad_norm > 0.01
    assert mega.metrics.keys() == ref.metrics.keys() and "moe/aux_loss" in ref.metrics
    for k in ref.metrics:
        assert mega.metrics[k] == pytest.approx(ref.metrics[k], rel=1e-4, abs=1e-6), k
    if case == "losses_and_replay":
        assert ref.metrics["moe/route_mismatch"] > 0.5
    assert weights[0].keys() == weights[1].keys()
    for name in weights[1]:
        torch.testing.assert_close(weights[0][name], weights[1][name], atol=1e-6, rtol=0, msg=name)


def checkpoint_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' gradients under checkpoint names (its fused experts split one expert at a time)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("experts.gate_up_proj"):
            for e, g in enumerate(p.grad):
                gate, up = g.chunk(2)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            out.update({f"{name[:-len('down_proj')]}{e}.down_proj.weight": g for e, g in enumerate(p.grad)})
        else:
            out[name] = p.grad
    return out


def router_losses(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, z) per layer of one micro-batch over its real tokens, from transformers' router logits."""
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, output_router_logits=True)
    real = mb.attention_mask.reshape(-1).bool()
    aux, z = [], []
    for lg in out.router_logits:
        lg = lg.float()[real]
        probs = torch.softmax(lg, -1)
        counts = torch.bincount(torch.topk(probs, K, -1).indices.reshape(-1), minlength=EXPERTS).float()
        aux.append(EXPERTS * (counts / (len(lg) * K) * probs.mean(0)).sum())
        z.append(torch.logsumexp(lg, -1).square().mean())
    return torch.stack(aux), torch.stack(z)


def test_router_losses_are_logged_added_and_trained(moe_dir: Path) -> None:
    """aux and z losses (micro-batches of 2 rows, weighted by real tokens) against their definition on
    transformers' router logits (independently of the torch backend's): the loss adds coef x their sum
    over layers, and the gradients are those of the same terms through transformers' model."""
    batch = batch_of(6)
    aux_coef, z_coef = 0.3, 0.02
    hf = AutoModelForCausalLM.from_pretrained(moe_dir)
    total = batch.attention_mask.sum()
    want_aux = want_z = want_term = 0.0
    for start in range(0, 6, 2):
        mb = batch.rows(start, start + 2)
        aux, z = router_losses(hf, mb)
        share = mb.attention_mask.sum() / total
        want_aux, want_z = want_aux + share * aux.detach().mean(), want_z + share * z.detach().mean()
        want_term = want_term + share * (aux_coef * aux.sum() + z_coef * z.sum())
    want_term.backward()  # type: ignore[union-attr]
    want_term = want_term.detach()  # type: ignore[union-attr]

    def zero_loss(mb: Batch, rows: slice, out: object) -> tuple[torch.Tensor, dict[str, float]]:
        return out.logprobs.sum() * 0.0, {}  # type: ignore[attr-defined]

    be = MegatronBackend(moe_dir, device="cpu", micro_batch_size=2, optim=OptimizerSettings(lr=0.0, grad_clip=0.0),
                         moe=MoeConfig(aux_loss_coef=aux_coef, z_loss_coef=z_coef))
    result = be.train_step(batch, zero_loss, 1.0)
    assert result.applied
    assert result.metrics["moe/aux_loss"] == pytest.approx(float(want_aux), rel=1e-5)
    assert result.metrics["moe/z_loss"] == pytest.approx(float(want_z), rel=1e-5)
    assert result.loss == pytest.approx(float(want_term), rel=1e-5)
    assert float(want_aux) > 1.01  # not balanced: the aux loss has something to say
    got, want = hf_grads(be), checkpoint_grads(hf)
    for name in got:  # what the terms do not reach (the experts, the head) has none in transformers
        ref = want.get(name, torch.zeros_like(got[name]))
        # float32 rounding of sums of many terms, relative to the tensor's largest gradient
        torch.testing.assert_close(got[name], ref, atol=1e-5 * max(float(ref.abs().max()), 0.1), rtol=1e-4,
                                   msg=name)
    assert want["model.layers.0.mlp.gate.weight"].abs().max() > 1e-3


def test_parallel_sizes_that_cannot_split_the_experts_are_refused(moe_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"train\.megatron\.expert_parallel: 3 does not divide the 8 experts"):
        MegatronBackend(moe_dir, device="cpu", parallel=MegatronConfig(expert_parallel=3))
    with pytest.raises(ValueError, match=r"train\.megatron: world size 1 is not a multiple of tensor_parallel"):
        MegatronBackend(moe_dir, device="cpu", parallel=MegatronConfig(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"train\.megatron\.expert_parallel: 2 does not divide tensor_parallel x "
                                         r"data-parallel size 1"):
        MegatronBackend(moe_dir, device="cpu", parallel=MegatronConfig(expert_parallel=2))


@pytest.mark.parametrize("layout", ["ep2", "tp2", "tp2_ep2"])
def test_two_parallel_ranks_compute_what_one_process_computes(layout: str, moe_dir: Path, tmp_path: Path) -> None:
    """Expert parallel over data-parallel ranks; tensor (sequence) parallel with whole experts on both
    ranks; and the experts split over the tensor-parallel ranks. The last two replay a record and train
    the router losses, on micro-batches of odd lengths (padded for the sequence's two parts)."""
    from moe_parallel_worker import backend, run_step, step_batch

    batch = step_batch(layout)
    assert any(batch.rows(i, i + 2).input_ids.shape[1] % 2 for i in range(0, 6, 2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.pt"
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(moe_dir), str(out), layout], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, 240)
    got = torch.load(out, weights_only=False)
    assert got["layout"] == {"ep2": (1, 2, 2), "tp2": (2, 1, 1), "tp2_ep2": (2, 1, 2)}[layout]

    want = run_step(backend(moe_dir, layout), layout)
    torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["metrics"].keys() == want["metrics"].keys()
    for k in want["metrics"]:
        assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=1e-4, abs=1e-6), k
    if layout != "ep2":
        assert want["metrics"]["moe/route_mismatch"] > 0.5 and want["metrics"]["moe/aux_loss"] > 1.0
    assert got["before"].keys() == want["before"].keys() == got["after"].keys()
    for name in want["before"]:
        assert torch.equal(got["before"][name], want["before"][name]), name
        torch.testing.assert_close(got["after"][name], want["after"][name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_router_is_set_in_either_form_of_megatrons_moe_spec() -> None:
    """megatron-core 0.16 (CPU) gives the MoE layer's spec as a ModuleSpec, 0.19 (the GPU machine's,
    Python 3.12) as `partial(MoELayer, submodules=...)`: our router goes into both."""
    import functools
    from types import SimpleNamespace

    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime_async.train.megatron.model import set_router
    from slime_async.train.megatron.moe_router import QwenRouter

    old = ModuleSpec(module=object, submodules=SimpleNamespace(router=None, experts=None))
    new = functools.partial(dict, submodules=SimpleNamespace(router=None, experts=None))
    for spec in (old, new):
        set_router(spec, QwenRouter)
    assert old.submodules.router is QwenRouter and new.keywords["submodules"].router is QwenRouter


def assert_same_logprobs_and_step(got_be: MegatronBackend, want_be: MegatronBackend, batch: Batch,
                                  replayed: Batch) -> None:
    """Logprobs routed by the model and replayed, then one train step with replay and both router losses:
    loss, metrics, the gradients of every expert and the weights after it (float32 rounding)."""
    for b in (batch, replayed):
        torch.testing.assert_close(got_be.logprobs(b, 0.7).logprobs, want_be.logprobs(b, 0.7).logprobs, atol=1e-6,
                                   rtol=0)
    obj = Objective(TrainConfig(loss="grpo", entropy_coef=0.01))
    results = []
    for be in (got_be, want_be):
        prep = obj.prepare(replayed, be.logprobs(replayed, 1.0).logprobs)
        results.append(be.train_step(replayed, obj.loss_fn(prep), 1.0, entropy=True))
    got, want = results
    assert got.applied and want.applied
    assert got.loss == pytest.approx(want.loss, rel=1e-6, abs=1e-8)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    assert got.metrics.keys() == want.metrics.keys() and want.metrics["moe/route_mismatch"] > 0.5
    for k in want.metrics:
        assert got.metrics[k] == pytest.approx(want.metrics[k], rel=1e-5, abs=1e-7), k
    got_grads, want_grads = hf_grads(got_be), hf_grads(want_be)
    assert got_grads.keys() == want_grads.keys()
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-7, rtol=1e-5, msg=name)
    after = dict(want_be.named_weights())
    for name, tensor in got_be.named_weights():
        torch.testing.assert_close(tensor, after[name], atol=1e-7, rtol=0, msg=name)


def replayed_batches(moe_dir: Path) -> tuple[Batch, Batch]:
    """A batch, and the same with other experts than the model's own recorded (some tokens unreported)."""
    batch = batch_of(6)
    forced = (own_routes(AutoModelForCausalLM.from_pretrained(moe_dir), batch) + 3) % EXPERTS
    forced[:, 1::4] = -1
    return batch, batch_with(batch, forced)


def test_local_dispatch_computes_what_megatrons_all_to_all_dispatcher_computes(moe_dir: Path) -> None:
    """`train.megatron.moe_local_dispatch` (the default with one expert-parallel rank: a sort on the device)
    against Megatron's all-to-all dispatcher, both with grouped experts, on the same weights."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from slime_async.train.megatron.local_dispatch import LocalSortDispatcher

    batch, replayed = replayed_batches(moe_dir)
    kw = dict(device="cpu", optim=OptimizerSettings(lr=1e-3, eps=1e-6, grad_clip=0.01), micro_batch_size=2,
              moe=MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02))
    local, alltoall = (MegatronBackend(moe_dir, parallel=MegatronConfig(moe_local_dispatch=on), **kw)  # type: ignore[arg-type]
                       for on in (True, False))
    assert all(type(layer.mlp.token_dispatcher) is LocalSortDispatcher for layer in local.module.decoder.layers)
    assert type(alltoall.module.decoder.layers[0].mlp.token_dispatcher) is MoEAlltoAllTokenDispatcher
    assert_same_logprobs_and_step(local, alltoall, batch, replayed)


def test_local_dispatch_groups_rows_by_expert_and_sums_them_back() -> None:
    """The dispatcher alone: rows come grouped by expert (token order within one), the counts match, and
    combine returns each token's weighted sum; a row of the map with fewer than k experts set still
    leaves every row inside a group (the extra one weighs 0)."""
    from slime_async.train.megatron.local_dispatch import LocalSortDispatcher

    tokens, experts, k, hidden = 7, 5, 2, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :k]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, ids, True)
    routing_map[3] = False
    routing_map[3, 4] = True  # one expert only
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    d = LocalSortDispatcher(experts, k)
    rows, weights = d.token_dispatch(*d.dispatch_preprocess(x, routing_map, probs))
    rows, counts, weights = d.dispatch_postprocess(rows, weights)
    assert rows.shape == (tokens * k, hidden) and int(counts.sum()) == tokens * k
    assert counts[4] >= int(routing_map[:, 4].sum())
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * weights[:, None])))
    torch.testing.assert_close(out, (probs.sum(1)[:, None] * x[:, 0])[:, None])
    expert_of_row = torch.repeat_interleave(torch.arange(experts), counts)
    # each group's rows are that expert's: weights equal the probs of (the row's token, that expert)
    token_of_row = [int(torch.nonzero((x[:, 0] == r).all(1))[0]) for r in rows]
    torch.testing.assert_close(weights, probs[token_of_row, expert_of_row])


def test_take_rows_is_a_gather_of_repeated_rows_forward_and_backward() -> None:
    """`take_rows` (the dispatcher's permutation, whose backward is a copy and a sum over k instead of an
    atomic scatter-add) against autograd of the plain form, `x.repeat_interleave(k)[order]`, and torch's
    numerical gradient check."""
    from slime_async.train.megatron.local_dispatch import take_rows

    tokens, k, hidden = 6, 3, 4
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(tokens * k, generator=g)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(tokens * k, hidden, generator=g, dtype=torch.float64)
    got = take_rows(x, order, k)
    want = x.repeat_interleave(k, dim=0)[order]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    (got_grad,) = torch.autograd.grad(got, x, upstream)
    (want_grad,) = torch.autograd.grad(want, x, upstream)
    torch.testing.assert_close(got_grad, want_grad)
    assert torch.autograd.gradcheck(lambda t: take_rows(t, order, k), (x,))


def test_grouped_experts_compute_what_sequential_mlp_computes(moe_dir: Path) -> None:
    """`train.megatron.moe_grouped_gemm` (the default; two `torch._grouped_mm` per layer over stacked
    weights) against Megatron's SequentialMLP (a loop over the experts) on the same weights: logprobs
    routed by the model and replayed, and one train step with replay and both router losses (loss,
    metrics, gradients of every expert, the weights after it)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from slime_async.moe.experts import can_group
    from slime_async.train.megatron.grouped_experts import GroupedExperts

    batch, replayed = replayed_batches(moe_dir)
    kw = dict(device="cpu", optim=OptimizerSettings(lr=1e-3, eps=1e-6, grad_clip=0.01), micro_batch_size=2,
              moe=MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02))
    grouped, looped = (MegatronBackend(moe_dir, parallel=MegatronConfig(moe_grouped_gemm=on), **kw)  # type: ignore[arg-type]
                       for on in (True, False))
    experts = grouped.module.decoder.layers[0].mlp.experts
    assert type(experts) is GroupedExperts and type(looped.module.decoder.layers[0].mlp.experts) is SequentialMLP
    # every expert's [gate; up] and down stacked (tiny-moe: hidden 256, experts of 256)
    assert experts.weight1.shape == (EXPERTS, 2 * 256, 256) and experts.weight2.shape == (EXPERTS, 256, 256)
    # the real grouped kernel runs here (torch's CPU kernel in float32), not the per-expert fallback
    assert can_group(torch.zeros(1, 256), experts.weight1.detach().transpose(1, 2))
    assert_same_logprobs_and_step(grouped, looped, batch, replayed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_experts_on_a_gpu_in_bfloat16_match_sequential_mlp(moe_dir: Path) -> None:
    """On a GPU in bf16 the grouped experts run torch's CUTLASS grouped GEMM (Hopper), SequentialMLP one
    cuBLAS GEMM per expert: with every token's experts replayed (no routing flip can hide or add a
    difference) the logprobs, the train step's loss, gradient norm and router metrics agree to bf16 rounding."""
    from slime_async.moe.experts import can_group

    batch = batch_of(6)
    replayed = batch_with(batch, own_routes(AutoModelForCausalLM.from_pretrained(moe_dir), batch))
    kw = dict(device="cuda", dtype="bfloat16", optim=OptimizerSettings(lr=1e-3), micro_batch_size=2,
              moe=MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02))
    # fused_logprobs off: no compilation for these few short micro-batches (the experts are what is compared)
    grouped, looped = (MegatronBackend(moe_dir, parallel=MegatronConfig(moe_grouped_gemm=on, fused_logprobs=False),
                                       **kw)  # type: ignore[arg-type]
                       for on in (True, False))
    w = grouped.module.decoder.layers[0].mlp.experts.weight1
    assert w.dtype == torch.bfloat16 and can_group(torch.zeros(1, 256, dtype=w.dtype, device=w.device),
                                                   w.detach().transpose(1, 2))
    got, want = grouped.logprobs(replayed, 1.0).logprobs, looped.logprobs(replayed, 1.0).logprobs
    real = batch.attention_mask.bool()
    diff = (got - want)[real].abs()
    assert float(diff.mean()) < 1e-2 and float(diff.max()) < 0.1, (float(diff.mean()), float(diff.max()))
    obj = Objective(TrainConfig(loss="grpo"))
    results = [be.train_step(replayed, obj.loss_fn(obj.prepare(replayed, be.logprobs(replayed, 1.0).logprobs)), 1.0)
               for be in (grouped, looped)]
    assert results[0].applied and results[1].applied
    assert results[0].loss == pytest.approx(results[1].loss, rel=0.05, abs=1e-3)
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=0.05)
    for k in ("moe/aux_loss", "moe/z_loss"):
        assert results[0].metrics[k] == pytest.approx(results[1].metrics[k], rel=0.02), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("local", [True, False])
def test_local_dispatch_never_makes_the_host_wait_for_the_gpu(local: bool, moe_dir: Path) -> None:
    """A MoE layer's forward and backward queued behind a kernel that keeps the GPU busy for about a
    second: with the local dispatcher the host returns while that kernel still runs (nothing waited for
    the GPU); with Megatron's all-to-all dispatcher it returns only after (its host-side token counts
    wait for the GPU, whatever way they are synchronised), which shows that the check can fail.
    torch's sync debug mode did not see Megatron's wait on an H100 (megatron-core 0.19)."""
    be = MegatronBackend(moe_dir, device="cuda", dtype="bfloat16", micro_batch_size=2, moe=NO_AUX,
                         parallel=MegatronConfig(moe_local_dispatch=local, fused_logprobs=False))
    layer = be.module.decoder.layers[0].mlp
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        out, _ = layer(x)
        out.float().square().sum().backward()

    step()  # the first calls probe the grouped kernel
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles, queued ahead of the step
    step()
    gpu_done_when_host_returned = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert gpu_done_when_host_returned is (not local)
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_a_checkpoint_of_one_expert_layout_is_refused_by_the_other(moe_dir: Path, mega: MegatronBackend,
                                                                   tmp_path: Path) -> None:
    """Grouped experts keep two stacked tensors a layer and SequentialMLP two per expert: their optimizer
    states differ, so resuming across `train.megatron.moe_grouped_gemm` is refused, naming it (it failed
    inside the optimizer's load before)."""
    mega.save(tmp_path / "ckpt")
    looped = MegatronBackend(moe_dir, device="cpu", micro_batch_size=4, moe=NO_AUX,
                             parallel=MegatronConfig(moe_grouped_gemm=False))
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        looped.load(tmp_path / "ckpt")
    MegatronBackend(moe_dir, device="cpu", micro_batch_size=4, moe=NO_AUX).load(tmp_path / "ckpt")  # same: loads
