"""SlotModel against HF's own forward pass: same logits, whatever the slots, lengths and chunking;
the static step (what CUDA graphs capture) against the dynamic one."""

from __future__ import annotations

import copy

import pytest
import torch

from slime_async.engine.graphs import CudaCapture, EagerDecoder, GraphDecoder, default_buckets, eager_capture
from slime_async.engine.model import SlotModel


def _hf_last(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_prefill_and_decode_match_the_hf_forward(reference: torch.nn.Module) -> None:
    slots = SlotModel(reference, max_slots=5, max_len=300, initial_len=8)  # forces the cache to grow
    seqs = [[1, 2, 3, 4], list(range(20, 57)), [7]]
    for slot, ids in enumerate(seqs):
        last = slots.prefill(slot, ids)
        torch.testing.assert_close(last[0], _hf_last(reference, ids), atol=1e-4, rtol=0)
    # chunked prefill: the second chunk continues the slot's cache
    ids = seqs[1]
    chunked = slots.prefill(3, ids[:15], all_logits=True)
    rest = slots.prefill(3, ids[15:], start=15, all_logits=True)
    with torch.no_grad():
        full = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat([chunked, rest]), full, atol=1e-4, rtol=0)
    # sequences of different lengths in one step
    tokens = [9, 10, 11]
    logits = slots.decode(tokens, [len(s) for s in seqs])
    for i, ids in enumerate(seqs):
        seqs[i] = [*ids, tokens[i]]
        torch.testing.assert_close(logits[i], _hf_last(reference, seqs[i]), atol=1e-4, rtol=0)
    # the first sequence leaves: the last one moves into its slot and continues from there
    slots.move(2, 0, len(seqs[2]))
    seqs = [seqs[2], seqs[1]]
    logits = slots.decode([12, 13], [len(s) for s in seqs])
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(logits[i], _hf_last(reference, [*ids, 12 + i]), atol=1e-4, rtol=0)


def test_static_step_equals_the_dynamic_step(reference: torch.nn.Module) -> None:
    """Padded batch, attention over the whole capacity: the real rows' logits do not change."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9)]

    def run(padded: bool) -> list[torch.Tensor]:
        slots = SlotModel(reference, max_slots=4, max_len=64, initial_len=32)
        for slot, ids in enumerate(prompts):
            slots.prefill(slot, ids)
        tokens, positions = [4, 5, 6], [len(p) for p in prompts]
        out = []
        for _ in range(3):
            if padded:
                ids = torch.tensor([*tokens, 0])
                pos = torch.tensor([*positions, 0])
                logits = slots.decode_static(ids, pos, slots.capacity)[:3]
            else:
                logits = slots.decode(tokens, positions)
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
        return out

    dynamic, static = run(False), run(True)
    for d, s in zip(dynamic, static, strict=True):
        # not bitwise: the matmul kernels differ by batch size; as close as HF and the engine are
        assert torch.equal(d.argmax(-1), s.argmax(-1))
        torch.testing.assert_close(s, d, atol=1e-4, rtol=0)


def test_graph_decoder_pads_to_buckets_and_follows_the_cache(reference: torch.nn.Module) -> None:
    """The graph path's plumbing on CPU (the recording replaced by eager replays): buckets,
    padding into free slots, re-recording when the cache grows; logits as the eager decoder's."""
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_buckets(1) == [1]
    eager_slots = SlotModel(reference, max_slots=4, max_len=64, initial_len=8)
    graph_slots = SlotModel(reference, max_slots=4, max_len=64, initial_len=8)
    eager, graphs = EagerDecoder(eager_slots), GraphDecoder(graph_slots, eager_capture, buckets=[2, 4])
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    for slots in (eager_slots, graph_slots):
        for slot, ids in enumerate(prompts):
            slots.prefill(slot, ids)
    tokens, positions = [1, 2, 3], [len(p) for p in prompts]
    for step in range(6):  # crosses capacity 8 -> 16: recorded again
        if step == 3:  # the middle sequence leaves: 3 rows -> bucket 4, then 2 rows -> bucket 2
            for slots in (eager_slots, graph_slots):
                slots.move(2, 1, positions[2])
            tokens, positions = [tokens[0], tokens[2]], [positions[0], positions[2]]
        a = eager.decode(tokens, positions)
        b = graphs.decode(tokens, positions)
        assert b.shape == a.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        tokens = a.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    assert graph_slots.capacity == 16
    # bucket 4 and bucket 2 at capacity 8, bucket 2 again at 16
    assert graphs.captures == 3
    graphs.release()  # e.g. release_memory_occupation: recorded again at the next step
    graphs.decode(tokens, positions)
    assert graphs.captures == 4


class _Pools:
    """`eager_capture` that counts the pools it was told to start (as `CudaCapture.new_pool`)."""

    def __init__(self) -> None:
        self.pools = 1

    def __call__(self, step):  # type: ignore[no-untyped-def]
        return eager_capture(step)

    def new_pool(self) -> None:
        self.pools += 1


def test_dropped_graphs_leave_their_pool_behind(reference: torch.nn.Module) -> None:
    """When the cache grows or memory is released every graph is dropped, and with them torch frees
    their pool: the decoder records into a new one from then on (CPU: the plumbing; the GPU test
    below: the real allocator, which refuses a freed pool's handle)."""
    slots = SlotModel(reference, max_slots=2, max_len=64, initial_len=8)
    capture = _Pools()
    graphs = GraphDecoder(slots, capture, buckets=[2])
    slots.prefill(0, [5, 6, 7])
    graphs.decode([1], [3])
    assert capture.pools == 1  # the first recording uses the first pool
    graphs.decode([1], [9])  # capacity 8 -> 16: graphs dropped
    assert slots.capacity == 16 and capture.pools == 2 and graphs.captures == 2
    graphs.release()
    graphs.decode([1], [10])
    assert capture.pools == 3 and graphs.captures == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recording_again_after_the_cache_grows_on_a_gpu(reference: torch.nn.Module) -> None:
    """A long request grows the cache: its graphs are recorded again, in a new pool (into the old
    pool's handle torch failed an internal assert and the engine aborted every request)."""
    model = copy.deepcopy(reference).to("cuda")  # the session's model stays on the CPU
    slots = SlotModel(model, max_slots=2, max_len=64, initial_len=8)
    eager_slots = SlotModel(model, max_slots=2, max_len=64, initial_len=8)
    graphs, eager = GraphDecoder(slots, CudaCapture(), buckets=[1, 2]), EagerDecoder(eager_slots)
    for s in (slots, eager_slots):
        s.prefill(0, [5, 6, 7])
    token = 1
    for position in range(3, 20):  # 8 -> 16 -> 32
        a = eager.decode([token], [position])
        b = graphs.decode([token], [position])
        torch.testing.assert_close(b, a, atol=1e-3, rtol=0)
        token = int(a.argmax(-1)[0])
    graphs.release()  # as release_memory_occupation does
    torch.testing.assert_close(graphs.decode([token], [20]), eager.decode([token], [20]), atol=1e-3, rtol=0)
    assert slots.capacity == 32 and graphs.captures == 4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_other_families_match_hf(family: str) -> None:
    """Llama (no biases) and Qwen3 (QK-norm) layouts, random small models made here."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    slots = SlotModel(model, max_slots=2, max_len=64)
    ids = [[3, 9, 27, 81], [5, 25]]
    for slot, prompt in enumerate(ids):
        torch.testing.assert_close(slots.prefill(slot, prompt)[0], _hf_last(model, prompt), atol=1e-4, rtol=0)
    logits = slots.decode([7, 8], [4, 2])
    for i, prompt in enumerate(ids):
        torch.testing.assert_close(logits[i], _hf_last(model, [*prompt, 7 + i]), atol=1e-4, rtol=0)


def test_context_limit_is_an_error(reference: torch.nn.Module) -> None:
    slots = SlotModel(reference, max_slots=1, max_len=16, initial_len=4)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        slots.prefill(0, list(range(1, 20)))


def test_batched_prefill_equals_one_at_a_time(reference: torch.nn.Module) -> None:
    """Prompts of different lengths in one padded forward: each one's logits and cache as alone."""
    prompts = [[4, 5, 6], list(range(30, 49)), [9]]
    slots = SlotModel(reference, max_slots=4, max_len=64, initial_len=8)
    logits = slots.prefill_batch(1, prompts)
    assert logits.shape == (3, reference.config.vocab_size)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], _hf_last(reference, ids), atol=1e-4, rtol=0)
    # the padding left nothing that the next token would see
    slots.ensure_capacity(20)
    step = slots.decode_static(torch.tensor([0, 7, 7, 7]), torch.tensor([0, *map(len, prompts)]), slots.capacity)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(step[i + 1], _hf_last(reference, [*ids, 7]), atol=1e-4, rtol=0)
