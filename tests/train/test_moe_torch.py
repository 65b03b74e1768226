"""The torch backend on the tiny Qwen3-MoE model: checkpoint names, routing replay, router losses.

The references are transformers' own: its forward, its routers' outputs (captured or overridden by
forward hooks, a code path apart from the backend's replacement forward) and its
`load_balancing_loss_func`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter, load_balancing_loss_func

from slime_async.config.schema import MoeConfig, TrainConfig
from slime_async.train.backend import OptimizerSettings
from slime_async.train.batch import Batch, build_batch
from slime_async.train.objective import Objective
from slime_async.train.synthetic import make_trajectories
from slime_async.train.torch_backend import TorchBackend

LAYERS, K, E = 4, 2, 8


def backend(model_dir: Path, micro_batch_size: int = 3, **kw: object) -> TorchBackend:
    return TorchBackend(model_dir, device="cpu", micro_batch_size=micro_batch_size, **kw)  # type: ignore[arg-type]


def batch_of(n: int = 6, seed: int = 0) -> Batch:
    b = build_batch(make_trajectories(n, seed=seed, vocab=800), max_seq_len=64).batch
    assert b is not None
    return b


def hf_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    ids, attn = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], 1) * attn


def own_routes(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[N, T, layers x top_k] of transformers' own routing, captured by hooks on its routers."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for m in model.modules()
             if isinstance(m, Qwen3MoeTopKRouter)]
    hf_logprobs(model, batch)
    for h in hooks:
        h.remove()
    n, t = batch.input_ids.shape
    return torch.cat([s.reshape(n, t, K) for s in seen], dim=-1).to(torch.int16)


def forced_logprobs(model: torch.nn.Module, batch: Batch, routes: torch.Tensor) -> torch.Tensor:
    """transformers' forward with every router's choice overridden by `routes` (-1: its own)."""
    layer_of = {m: i for i, m in enumerate(m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter))}

    def force(module: torch.nn.Module, _inputs: object, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, _, experts = out
        lo = layer_of[module] * K
        record = routes.reshape(-1, routes.shape[-1])[:, lo:lo + K].long()
        experts = torch.where(record >= 0, record, experts)
        weights = torch.softmax(logits, -1, dtype=torch.float).gather(1, experts)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts

    hooks = [m.register_forward_hook(force) for m in layer_of]
    try:
        return hf_logprobs(model, batch)
    finally:
        for h in hooks:
            h.remove()


def test_named_weights_are_the_checkpoints_names_and_values(tiny_moe_dir: Path) -> None:
    saved = load_file(tiny_moe_dir / "model.safetensors")
    exported = dict(backend(tiny_moe_dir).named_weights())
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in exported


def test_logprobs_equal_transformers_and_replay_of_its_own_routing_changes_nothing(tiny_moe_dir: Path) -> None:
    be = backend(tiny_moe_dir)
    assert be.route_width == LAYERS * K
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    batch = batch_of()
    plain = be.logprobs(batch, 1.0).logprobs
    torch.testing.assert_close(plain, hf_logprobs(hf, batch), atol=1e-5, rtol=0)
    batch.routed_experts = own_routes(hf, batch)
    torch.testing.assert_close(be.logprobs(batch, 1.0).logprobs, plain, atol=1e-5, rtol=0)


def test_replay_forces_the_engines_experts_and_unreported_tokens_route_themselves(tiny_moe_dir: Path) -> None:
    be = backend(tiny_moe_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    batch = batch_of()
    own = own_routes(hf, batch)
    forced = ((own.long() + 3) % E).to(torch.int16)  # other experts for every token and layer...
    forced[:, ::2] = -1  # ...but every other position unreported
    batch.routed_experts = forced
    replayed = be.logprobs(batch, 1.0).logprobs
    torch.testing.assert_close(replayed, forced_logprobs(hf, batch, forced), atol=1e-5, rtol=0)
    unreplayed = be.logprobs(Batch(**{**batch.__dict__, "routed_experts": None}), 1.0).logprobs
    assert (replayed - unreplayed).abs().max() > 1e-3


def test_malformed_record_rows_route_themselves(tiny_moe_dir: Path) -> None:
    """An engine's record is another process's message: a row with an id out of range or a repeated id
    is not replayed (the token routes itself), and nothing indexes out of bounds."""
    be = backend(tiny_moe_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    batch = batch_of()
    forced = ((own_routes(hf, batch).long() + 3) % E).to(torch.int16)
    bad = forced.clone()
    bad[:, 0::3, 0] = E + 5  # out of range in layer 0's first slot
    bad[:, 1::3, 2] = bad[:, 1::3, 3]  # layer 1's two ids the same
    batch.routed_experts = bad
    got = be.logprobs(batch, 1.0).logprobs
    want = forced.clone()
    want[:, 0::3, 0:K] = -1  # what a usable-rows-only replay means: those (token, layer)s route themselves
    want[:, 1::3, K:2 * K] = -1
    torch.testing.assert_close(got, forced_logprobs(hf, batch, want), atol=1e-5, rtol=0)


def test_replay_off_ignores_the_record(tiny_moe_dir: Path) -> None:
    be = backend(tiny_moe_dir, moe=MoeConfig(routing_replay=False))
    assert be.route_width is None
    batch = batch_of()
    plain = be.logprobs(batch, 1.0).logprobs
    batch.routed_experts = torch.zeros(*batch.input_ids.shape, LAYERS * K, dtype=torch.int16)
    assert torch.equal(be.logprobs(batch, 1.0).logprobs, plain)


def test_router_losses_are_switch_and_z_losses_and_train_with_their_weights(tiny_moe_dir: Path) -> None:
    batch = batch_of()
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    with torch.no_grad():
        out = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    # transformers' loss over one layer counts each of the k choices per token: k times ours
    valid = batch.attention_mask.reshape(-1).bool()
    aux = [float(load_balancing_loss_func((lg,), E, K, batch.attention_mask)) / K for lg in out.router_logits]
    z = [float((torch.logsumexp(lg[valid], -1) ** 2).mean()) for lg in out.router_logits]

    obj = Objective(TrainConfig(loss="grpo"))
    results = {}
    for coefs in ((0.0, 0.0), (0.5, 0.25)):
        # one micro-batch: the losses are products of means over a micro-batch's tokens (as Megatron's)
        be = backend(tiny_moe_dir, micro_batch_size=6, moe=MoeConfig(aux_loss_coef=coefs[0], z_loss_coef=coefs[1]))
        prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
        results[coefs] = be.train_step(batch, obj.loss_fn(prep), 1.0)
    plain, weighted = results[(0.0, 0.0)], results[(0.5, 0.25)]
    assert plain.metrics["moe/aux_loss"] == pytest.approx(sum(aux) / LAYERS, rel=1e-4)
    assert plain.metrics["moe/z_loss"] == pytest.approx(sum(z) / LAYERS, rel=1e-4)
    assert weighted.loss - plain.loss == pytest.approx(0.5 * sum(aux) + 0.25 * sum(z), rel=1e-4)
    assert weighted.grad_norm != pytest.approx(plain.grad_norm, rel=1e-6)


def test_the_default_aux_weight_is_the_checkpoints(tiny_moe_dir: Path) -> None:
    assert backend(tiny_moe_dir).aux_loss_coef == pytest.approx(0.001)
    assert backend(tiny_moe_dir, moe=MoeConfig(aux_loss_coef=0.0)).aux_loss_coef == 0.0


def test_a_step_reports_how_often_the_record_overrode_the_trainers_own_choice(tiny_moe_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    batch = batch_of()
    own = own_routes(hf, batch)
    obj = Objective(TrainConfig(loss="grpo"))
    mismatch = []
    for record in (own, ((own.long() + 3) % E).to(torch.int16)):
        be = backend(tiny_moe_dir)
        batch.routed_experts = record
        prep = obj.prepare(batch, be.logprobs(batch, 1.0).logprobs)
        mismatch.append(be.train_step(batch, obj.loss_fn(prep), 1.0).metrics["moe/route_mismatch"])
    # shifted experts everywhere: all of layer 0 differs; later layers see the replayed hidden states,
    # where the trainer's own choice now and then lands on the shifted pair itself
    assert mismatch[0] == 0.0 and mismatch[1] > 0.9


def test_experts_run_transformers_grouped_matmuls_which_equal_its_expert_loop(tiny_moe_dir: Path) -> None:
    """The torch backend's experts are transformers' `grouped_mm` implementation (its default: the
    sorted tokens through `torch._grouped_mm`, no loop over experts); its loop over experts ("eager")
    gives the same logprobs and gradients."""
    be = backend(tiny_moe_dir, micro_batch_size=6, optim=OptimizerSettings(lr=0.0, grad_clip=0.0))
    assert be.model.config._experts_implementation == "grouped_mm"
    batch = batch_of()
    obj = Objective(TrainConfig(loss="grpo"))
    out = []
    for impl in ("grouped_mm", "eager"):
        be.model.set_experts_implementation(impl)
        lp = be.logprobs(batch, 1.0).logprobs
        result = be.train_step(batch, obj.loss_fn(obj.prepare(batch, lp)), 1.0)  # lr 0: the weights stay
        out.append((lp, result.loss, {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}))
    (lp_g, loss_g, grads_g), (lp_e, loss_e, grads_e) = out
    torch.testing.assert_close(lp_g, lp_e, atol=1e-6, rtol=0)
    assert loss_g == pytest.approx(loss_e, rel=1e-6)
    assert grads_g.keys() == grads_e.keys() and any("experts.gate_up_proj" in n for n in grads_g)
    for n in grads_e:
        torch.testing.assert_close(grads_g[n], grads_e[n], atol=1e-6, rtol=1e-5, msg=n)
