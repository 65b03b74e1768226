"""SlotModel against HF's own forward pass: same logits, whatever the slots, lengths and chunking."""

from __future__ import annotations

import torch

from slime_async.engine.model import SlotModel


def test_prefill_and_decode_match_the_hf_forward(reference: torch.nn.Module) -> None:
    slots = SlotModel(reference, max_slots=5, max_len=300, initial_len=8)  # forces the cache to grow
    seqs = {0: [1, 2, 3, 4], 3: list(range(20, 57)), 4: [7]}
    for slot, ids in seqs.items():
        last = slots.prefill(slot, ids)
        with torch.no_grad():
            full = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(last, full[-1:], atol=1e-4, rtol=0)
    # chunked prefill: the second chunk continues the slot's cache
    ids = seqs[3]
    chunked = slots.prefill(1, ids[:15], all_logits=True)
    rest = slots.prefill(1, ids[15:], start=15, all_logits=True)
    with torch.no_grad():
        full = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat([chunked, rest]), full, atol=1e-4, rtol=0)
    # decode non-contiguous slots of different lengths in one step
    order = [0, 3, 4]
    tokens = [9, 10, 11]
    logits = slots.decode(order, tokens, [len(seqs[s]) for s in order])
    for i, slot in enumerate(order):
        with torch.no_grad():
            ref = reference(torch.tensor([seqs[slot] + [tokens[i]]])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)


def test_context_limit_is_an_error(reference: torch.nn.Module) -> None:
    slots = SlotModel(reference, max_slots=1, max_len=16, initial_len=4)
    try:
        slots.prefill(0, list(range(1, 20)))
    except ValueError as exc:
        assert "exceeds the context of 16" in str(exc)
    else:
        raise AssertionError("no error")
