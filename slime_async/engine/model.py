"""A decoder-only HF model run step by step with one KV cache slot per sequence.

HF's `generate` runs a fixed batch to the end; continuous batching needs sequences of different
lengths to join and leave between decode steps. This module keeps the HF model's own modules
(embeddings, norms, MLPs, rotary embedding, projections: so weight updates by HF name apply
directly) and replaces only the attention's cache handling: each sequence owns a slot of a
preallocated cache, and one decode step attends every active slot up to its own length.
Supports the Llama family layout (Llama, Qwen2 with QKV bias, Qwen3 with QK-norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotModel:
    """Prefill and decode over per-sequence cache slots; not thread-safe (one loop drives it)."""

    def __init__(self, model: nn.Module, max_slots: int, max_len: int, initial_len: int = 256) -> None:
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_slots = max_slots
        self.max_len = max_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._initial_len = initial_len
        self.allocate()

    def allocate(self) -> None:
        """(Re)create an empty cache at its initial size; every slot's contents are gone."""
        self._cap = min(self._initial_len, self.max_len)
        shape = (self.max_slots, self.num_kv_heads, self._cap, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]

    def release(self) -> None:
        """Drop the cache tensors (their memory goes back to the allocator); `allocate` before use."""
        self.k, self.v = [], []
        self._cap = 0

    def _ensure_capacity(self, length: int) -> None:
        if length <= self._cap:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the context of {self.max_len}")
        new_cap = min(self.max_len, max(length, self._cap * 2))
        pad = new_cap - self._cap
        self.k = [F.pad(k, (0, 0, 0, pad)) for k in self.k]
        self.v = [F.pad(v, (0, 0, 0, pad)) for v in self.v]
        self._cap = new_cap

    @torch.inference_mode()
    def prefill(self, slot: int, input_ids: list[int], start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Run `input_ids` at positions start.. in `slot` (its cache before `start` is kept).

        Returns the logits of the last position, shape [1, vocab], or of every position with
        `all_logits` (the LM head over a long prompt costs as much as the layers for real vocabularies).
        """
        n = len(input_ids)
        self._ensure_capacity(start + n)
        ids = torch.tensor([input_ids], device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        # query i (position start+i) sees cache positions 0..start+i
        mask = torch.arange(start + n, device=self.device)[None, :] <= positions[:, None]
        slots = torch.tensor([slot], device=self.device)
        return self._forward(ids, positions[None, :], slots, mask[None, None], start + n, all_logits)[0]

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One step for several sequences: token i sits at positions[i] of slots[i]. Logits [B, vocab]."""
        self._ensure_capacity(max(positions) + 1)
        pos = torch.tensor(positions, device=self.device)
        total = int(pos.max()) + 1
        mask = torch.arange(total, device=self.device)[None, :] <= pos[:, None]
        ids = torch.tensor(tokens, device=self.device)[:, None]
        slot_t = torch.tensor(slots, device=self.device)
        return self._forward(ids, pos[:, None], slot_t, mask[:, None, None, :], total)[:, -1]

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, total: int,
        all_logits: bool = False,
    ) -> torch.Tensor:
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        b, s = ids.shape
        contiguous = bool(slots.numel() and int(slots[-1]) - int(slots[0]) + 1 == slots.numel()
                          and bool((slots.diff() == 1).all()))
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, s, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(b, s, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(b, s, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            # write this step's keys and values at their positions, then read each slot's prefix
            rows = slots[:, None].expand(b, s)
            self.k[li][rows, :, positions] = k.transpose(1, 2)
            self.v[li][rows, :, positions] = v.transpose(1, 2)
            if contiguous:
                first = int(slots[0])
                keys = self.k[li][first : first + b, :, :total]
                values = self.v[li][first : first + b, :, :total]
            else:
                keys = self.k[li].index_select(0, slots)[:, :, :total]
                values = self.v[li].index_select(0, slots)[:, :, :total]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not all_logits:
            x = x[:, -1:]
        return self.model.lm_head(inner.norm(x)).float()
