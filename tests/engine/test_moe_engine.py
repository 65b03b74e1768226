"""The embedded engine on a Qwen3-MoE model: logits and routed experts against transformers' own
Qwen3MoeForCausalLM, SGLang's routed-experts protocol over real HTTP, and weight updates by the
checkpoint's per-expert names."""

from __future__ import annotations

import ast
import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from helpers import perturbed_copy, post, wait_for_tokens
from sglang_source import class_defaults
from transformers import AutoModelForCausalLM

from slime_async.engine.graphs import Capture, CudaCapture, GraphDecoder, eager_capture
from slime_async.engine.model import SlotModel
from slime_async.engine.moe import GraphExperts
from slime_async.moe.routing import decode_sglang
from slime_async.moe.shape import moe_shape

PROMPTS = [[1, 2, 3, 4, 5], list(range(20, 47)), [7, 8]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-moe preset with seeded noise for weights: routing varies from token to token."""
    from slime_async.models.tiny_model import cached_model_dir

    return perturbed_copy(cached_model_dir("tiny-moe", seed=0), tmp_path_factory.mktemp("moe"), seed=1)


@pytest.fixture(scope="module")
def hf_moe(moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir).eval()


def hf_forward(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [S, vocab], the routers' top-k ids [S, layers x k]) of HF's own forward, the ids
    read by hooking every `Qwen3MoeTopKRouter`."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    chosen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
             for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.cat(chosen, dim=-1)


def test_prefill_and_decode_logits_and_routes_equal_hf(hf_moe: torch.nn.Module) -> None:
    shape = moe_shape(hf_moe.config)
    assert shape is not None and shape.route_width == 8
    slots = SlotModel(hf_moe, max_slots=4, max_len=128, initial_len=16)
    seqs = [list(p) for p in PROMPTS]
    last = slots.prefill_batch(0, seqs, record=True)
    recorded = slots.recorded
    assert recorded is not None and recorded.dtype == torch.int32
    for i, ids in enumerate(seqs):
        logits, routes = hf_forward(hf_moe, ids)
        torch.testing.assert_close(last[i], logits[-1], atol=1e-4, rtol=0)
        assert torch.equal(recorded[i, : len(ids)], routes.int())
    distinct = {tuple(r) for r in recorded[1, : len(seqs[1])].tolist()}
    assert len(distinct) > 10  # the routing really varies: the comparison means something
    # several decode steps of a batch of different lengths, eager (sparse experts) and recording
    for step in range(4):
        tokens = [int(last[i].argmax()) for i in range(len(seqs))]
        last = slots.decode(tokens, [len(s) for s in seqs], record=True)
        for i, ids in enumerate(seqs):
            ids.append(tokens[i])
            logits, routes = hf_forward(hf_moe, ids)
            torch.testing.assert_close(last[i], logits[-1], atol=1e-4, rtol=0, msg=f"step {step} row {i}")
            assert torch.equal(slots.step_routes[i], routes[-1].int())


def static_and_eager_steps_agree(model: torch.nn.Module, capture: Capture, experts: GraphExperts) -> None:
    """The graph's step (`experts`: dense or grouped, over a padded batch) gives the eager step's logits and ids."""
    def run(graph: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        slots = SlotModel(model, max_slots=4, max_len=64, initial_len=32, graph_experts=experts)
        decoder = GraphDecoder(slots, capture, buckets=[4]) if graph else None
        slots.prefill_batch(0, PROMPTS)
        out, tokens, positions = [], [3, 4, 5], [len(p) for p in PROMPTS]
        for _ in range(3):
            logits = decoder.decode(tokens, positions) if decoder else slots.decode(tokens, positions, record=True)
            out.append((logits.clone(), slots.step_routes[:3].clone()))
            tokens, positions = [int(t) for t in logits.argmax(-1)], [p + 1 for p in positions]
        return out

    for (a, ra), (b, rb) in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert torch.equal(ra, rb)


@pytest.mark.parametrize("experts", ["dense", "grouped"])
def test_static_step_equals_eager_step(hf_moe: torch.nn.Module, experts: GraphExperts) -> None:
    static_and_eager_steps_agree(hf_moe, eager_capture, experts)


def test_the_grouped_static_step_never_runs_every_expert(hf_moe: torch.nn.Module,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`graph_experts="grouped"`: the static step takes the sparse path, not the dense one."""
    from slime_async.engine import moe

    def every_expert(*args: object) -> torch.Tensor:
        raise AssertionError("the dense experts ran")

    monkeypatch.setattr(moe, "dense", every_expert)
    static_and_eager_steps_agree(hf_moe, eager_capture, "grouped")
    with pytest.raises(AssertionError, match="dense experts ran"):
        static_and_eager_steps_agree(hf_moe, eager_capture, "dense")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", ["dense", "grouped"])
def test_a_recorded_cuda_graph_step_equals_the_eager_step(moe_dir: Path, experts: GraphExperts) -> None:
    """On a GPU the engine replays recorded CUDA graphs of the static step (`CudaCapture`): the same
    logits and expert ids as the eager step, float32. `grouped` falls back to the dense experts here:
    CUDA's grouped GEMM takes bf16 only, and the per-expert fallback reads the host (a graph cannot
    capture it; the bf16 capture runs in `bench megatron_moe_gpu`)."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir).to("cuda").eval()
    static_and_eager_steps_agree(model, CudaCapture(), experts)


def test_unsupported_moe_config_is_one_clear_error(hf_moe: torch.nn.Module, moe_dir: Path, tmp_path: Path) -> None:
    from slime_async.engine.launch import load_engine

    bad = tmp_path / "bad"
    shutil.copytree(moe_dir, bad)
    config = (bad / "config.json").read_text()
    (bad / "config.json").write_text(config.replace('"norm_topk_prob"', '"n_shared_experts": 2, "norm_topk_prob"'))
    with pytest.raises(ValueError, match="n_shared_experts"):
        load_engine(bad, device="cpu")


# --- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_url(moe_dir: Path):
    from slime_async.launch.process import start_engine

    server = start_engine(moe_dir, "--max-batch-size", "4", "--context-length", "256")
    yield server.url
    server.stop()


def _routes(reply: dict, width: int = 8) -> np.ndarray:
    return decode_sglang(reply["meta_info"]["routed_experts"], width)


async def test_generate_returns_routed_experts_as_sglang(moe_url: str, hf_moe: torch.nn.Module) -> None:
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    prompt = PROMPTS[1]
    status, out = await post(moe_url, "/generate", {"input_ids": prompt, "sampling_params": greedy,
                                                    "return_routed_experts": True})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    full = prompt + out["output_ids"]
    _, hf_routes = hf_forward(hf_moe, full)
    routes = _routes(out)
    assert routes.shape == (len(full) - 1, 8)  # positions [0, seqlen - 1): the last token is never fed
    assert np.array_equal(routes, hf_routes[:-1].numpy())
    # from a start: positions [start_len, seqlen - 1); a batch shares the two fields, as in SGLang
    status, outs = await post(moe_url, "/generate", {"input_ids": [prompt, PROMPTS[0]], "sampling_params": greedy,
                                                     "return_routed_experts": True, "routed_experts_start_len": 5})
    assert status == 200, outs
    assert np.array_equal(_routes(outs[0]), hf_routes[5:-1].numpy())
    assert _routes(outs[1]).shape == (len(PROMPTS[0]) + 6 - 1 - 5, 8)
    # not asked: no key, as in SGLang
    status, plain = await post(moe_url, "/generate", {"input_ids": prompt, "sampling_params": greedy})
    assert status == 200 and "routed_experts" not in plain["meta_info"]
    assert plain["output_ids"] == out["output_ids"]
    # a prefill-only request: the prompt's positions but its last; start_len may be the prompt's length
    status, scored = await post(moe_url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                                                       "return_routed_experts": True})
    assert status == 200 and np.array_equal(_routes(scored), hf_routes[: len(prompt) - 1].numpy())
    status, empty = await post(moe_url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1},
                                                      "return_routed_experts": True,
                                                      "routed_experts_start_len": len(prompt)})
    assert status == 200 and empty["meta_info"]["routed_experts"] == ""
    # streaming: only the final event carries them (SGLang collects them when the request finishes)
    events = []
    async with aiohttp.ClientSession() as session, session.post(moe_url + "/generate", json={
            "input_ids": prompt, "sampling_params": greedy, "return_routed_experts": True, "stream": True}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    assert len(events[-1]["output_ids"]) == 6
    assert ["routed_experts" in e["meta_info"] for e in events] == [False] * (len(events) - 1) + [True]
    assert np.array_equal(_routes(events[-1]), routes)


def test_request_fields_are_sglangs(sglang_source: dict[str, ast.Module]) -> None:
    """The two fields, their types and defaults as SGLang 0.5.23's `GenerateReqInput` declares them."""
    from slime_async.engine.protocol import GenerateReqInput

    theirs = class_defaults(sglang_source["io"], "GenerateReqInput")
    ours = {f: getattr(GenerateReqInput(), f) for f in ("return_routed_experts", "routed_experts_start_len")}
    assert {f: ast.literal_eval(theirs[f]) for f in ours} == ours == {"return_routed_experts": False,
                                                                      "routed_experts_start_len": 0}


async def test_dense_model_reports_no_routed_experts(aiohttp_engine: str) -> None:
    """As SGLang without its experts capturer: the request is served, the key is left out."""
    status, out = await post(aiohttp_engine, "/generate", {"input_ids": [1, 2, 3], "return_routed_experts": True,
                                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and "routed_experts" not in out["meta_info"], out


async def test_aborted_request_reports_the_positions_it_fed(moe_url: str) -> None:
    """SGLang collects the routes of a request aborted while running (it finishes like any other);
    one aborted in the queue gets the short reply, without them."""
    body = {"input_ids": PROMPTS[0], "rid": "long-moe", "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    request = asyncio.ensure_future(post(moe_url, "/generate", body))
    await wait_for_tokens(moe_url)
    assert (await post(moe_url, "/abort_request", {"rid": "long-moe"}))[0] == 200
    status, out = await asyncio.wait_for(request, 60)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
    assert 0 < len(out["output_ids"]) < 200
    assert _routes(out).shape == (len(PROMPTS[0]) + len(out["output_ids"]) - 1, 8)


@pytest.mark.parametrize("start", [-1, len(PROMPTS[0]) + 1])
async def test_bad_routed_experts_start_len_is_a_400_naming_it(moe_url: str, start: int) -> None:
    status, out = await post(moe_url, "/generate", {"input_ids": PROMPTS[0], "return_routed_experts": True,
                                                    "routed_experts_start_len": start})
    assert status == 400 and "routed_experts_start_len" in out["error"]["message"], out


async def test_update_by_checkpoint_expert_names_changes_the_model(moe_url: str, moe_dir: Path) -> None:
    from slime_async.moe.hf_layout import checkpoint_views
    from slime_async.weight_wire.codec import encode_named_tensors

    changed = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    g = torch.Generator().manual_seed(5)
    views = checkpoint_views(changed)
    experts = {n: v for n, v in views.items() if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")}
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in experts
    with torch.no_grad():
        for v in experts.values():
            v.copy_(torch.randn(v.shape, generator=g) * 0.15)
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": PROMPTS[1], "sampling_params": greedy, "return_routed_experts": True}
    _, before = await post(moe_url, "/generate", body)
    status, out = await post(moe_url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_named_tensors({n: v.clone() for n, v in experts.items()})],
        "weight_version": "2"})
    assert status == 200 and out["success"], out
    status, after = await post(moe_url, "/generate", body)
    assert status == 200 and after["meta_info"]["weight_version"] == "2"
    assert after["output_ids"] != before["output_ids"]
    full = PROMPTS[1] + after["output_ids"]
    logits, routes = hf_forward(changed, full)
    assert after["output_ids"] == logits[len(PROMPTS[1]) - 1:-1].argmax(-1).tolist()
    assert np.array_equal(_routes(after), routes[:-1].numpy())
    # an unknown name is refused with its name, and nothing changes
    status, out = await post(moe_url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_named_tensors({"model.layers.0.mlp.experts.8.up_proj.weight":
                                                           torch.zeros(256, 256)})]})
    assert status == 400 and "model.layers.0.mlp.experts.8.up_proj.weight" in out["message"], out
    # the checkpoint on disk names its experts apart too: loading it restores the first outputs
    status, out = await post(moe_url, "/update_weights_from_disk", {"model_path": str(moe_dir), "weight_version": "3"})
    assert status == 200 and out["success"], out
    status, restored = await post(moe_url, "/generate", body)
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["routed_experts"] == before["meta_info"]["routed_experts"]


def loop_over_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mlp: object, act: object
                      ) -> torch.Tensor:
    """The engine's sparse experts as they were before grouped matmuls: one matmul per active expert."""
    import torch.nn.functional as F

    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    rows, out, start = h[token], torch.empty_like(h[token]), 0
    for e, count in enumerate(torch.bincount(flat, minlength=mlp.gate_up.shape[0]).tolist()):  # type: ignore[attr-defined]
        seg = slice(start, start + count)
        gate, up = F.linear(rows[seg], mlp.gate_up[e]).chunk(2, dim=-1)  # type: ignore[attr-defined]
        out[seg] = F.linear(act(gate) * up, mlp.down[e])  # type: ignore[attr-defined, operator]
        start += count
    return torch.zeros_like(h).index_add_(0, token, out * weights.reshape(-1)[order, None])


@pytest.mark.parametrize("tokens", [1, 32, 97])
def test_grouped_sparse_experts_equal_the_loop_over_experts(hf_moe: torch.nn.Module, tokens: int) -> None:
    """The eager step's experts (two grouped matmuls over all experts) against the per-expert loop they
    replace and the CUDA-graph step's dense form: one decode row, 32 concurrent requests, a prefill."""
    import torch.nn.functional as F

    from slime_async.engine import moe

    shape = moe_shape(hf_moe.config)
    assert shape is not None
    mlp = moe.moe_mlp(hf_moe.model.layers[1].mlp)
    h = torch.randn(tokens, hf_moe.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    weights, ids = moe.route(h, mlp, shape)
    with torch.no_grad():
        got = moe.sparse(h, weights, ids, mlp, F.silu)
        torch.testing.assert_close(got, loop_over_experts(h, weights, ids, mlp, F.silu), atol=1e-6, rtol=1e-6)
        # the dense form sums every expert (zero-weighted off the chosen ones) in another order: float32 noise
        # of up to 2e-5 was seen on some runs (the reduction order follows the threads torch has)
        torch.testing.assert_close(got, moe.dense(h, weights, ids, mlp, F.silu), atol=5e-5, rtol=1e-5)
    assert got.abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_sparse_experts_in_bfloat16_on_a_gpu_equal_the_loop_over_experts(moe_dir: Path) -> None:
    """bf16 on a GPU: the eager step's grouped experts (torch's CUTLASS grouped GEMM on Hopper) against
    one cuBLAS matmul per expert, 32 decode rows, to bf16 rounding."""
    import torch.nn.functional as F

    from slime_async.engine import moe

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).to("cuda").eval()
    shape = moe_shape(model.config)
    assert shape is not None
    mlp = moe.moe_mlp(model.model.layers[1].mlp)
    h = torch.randn(32, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        weights, ids = moe.route(h, mlp, shape)
        got = moe.sparse(h, weights, ids, mlp, F.silu)
        want = loop_over_experts(h, weights, ids, mlp, F.silu)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(want.abs().max()), rtol=2e-2)
