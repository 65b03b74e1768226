"""A decoder-only HF model run step by step with one KV cache slot per sequence.

HF's `generate` runs a fixed batch to the end; continuous batching needs sequences of different
lengths to join and leave between decode steps. This module keeps the HF model's parameters (so
weight updates by HF name apply directly, in place) but runs its own compact forward over them:
RMSNorm, RoPE from a precomputed cos/sin table, SDPA over a preallocated cache, the MLP; no HF
module calls, no per-step cache allocation. Supports the Llama family layout (Llama, Qwen2 with
QKV bias, Qwen3 with QK-norm) and Qwen3-MoE's sparse MLP (`moe`), which can record the experts
each token was routed to (SGLang's `return_routed_experts`).

Slots are kept compact by the engine: a batch of B sequences occupies slots 0..B-1 (`move`
fills a hole when a sequence leaves), so a decode step reads the cache as one contiguous slice
instead of gathering rows. `decode_static` is the same step with fixed shapes (padded batch,
attention over the whole cache capacity): what a CUDA graph captures (see `graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slime_async.engine.moe import GraphExperts, MoeMlp, moe_forward, moe_mlp
from slime_async.moe.shape import moe_shape


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters (the HF Parameter objects themselves: in-place updates and
    device moves keep them valid)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate: torch.Tensor | None
    up: torch.Tensor | None
    down: torch.Tensor | None
    moe: MoeMlp | None
    """The sparse MLP of an MoE layer (then gate, up and down are None)."""


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return linear.bias if getattr(linear, "bias", None) is not None else None


def _layer(layer: nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
        q=attn.q_proj.weight, k=attn.k_proj.weight, v=attn.v_proj.weight, o=attn.o_proj.weight,
        q_bias=_bias(attn.q_proj), k_bias=_bias(attn.k_proj), v_bias=_bias(attn.v_proj),
        q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
        k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
        gate=getattr(getattr(mlp, "gate_proj", None), "weight", None),
        up=getattr(getattr(mlp, "up_proj", None), "weight", None),
        down=getattr(getattr(mlp, "down_proj", None), "weight", None),
        moe=moe_mlp(mlp) if hasattr(mlp, "experts") else None,
    )


class SlotModel:
    """Prefill and decode over per-sequence cache slots; not thread-safe (one loop drives it)."""

    def __init__(self, model: nn.Module, max_slots: int, max_len: int, initial_len: int = 256,
                 graph_experts: GraphExperts = "dense") -> None:
        self.model = model
        self.graph_experts: GraphExperts = graph_experts
        """How an MoE model's static (CUDA-graph) step runs its experts: `dense` (every expert over every
        token, zero-weighted) or `grouped` (the sparse step's grouped matmuls, captured: the group ends
        stay on the device). The same values either way (`engine.moe`)."""
        inner = model.model
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = float(cfg.rms_norm_eps)
        self.moe = moe_shape(cfg)
        """The experts' layout (None: a dense model); an unsupported MoE config is a ValueError."""
        mlp = inner.layers[0].mlp
        self.act = mlp.experts.act_fn if self.moe is not None else mlp.act_fn
        self.layers = [_layer(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.max_slots = max_slots
        self.max_len = max_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._initial_len = initial_len
        self._rope_table()
        self.generation = 0
        """Bumped whenever the cache tensors are replaced: captured graphs hold their addresses."""
        self.allocate()
        self.recorded: torch.Tensor | None = None
        """Expert ids of the last forward that recorded (`record`): int32 [B, S, layers x top_k]
        (layer-major, each layer's k in descending probability: SGLang's order)."""
        self.step_routes = None if self.moe is None else torch.zeros(
            max_slots, self.moe.route_width, dtype=torch.int32, device=self.device)
        """Expert ids of the last decode step that recorded, rows 0..B-1: a fixed buffer, so a
        replayed CUDA graph rewrites it."""

    @torch.inference_mode()
    def _rope_table(self) -> None:
        # HF's own rotary module over every position once: the same values (an outer product, no
        # reduction), and no per-step matmul/cat/cos/sin
        rotary = self.model.model.rotary_emb
        dummy = torch.zeros(1, device=self.device, dtype=self.dtype)
        positions = torch.arange(self.max_len, device=self.device)[None]
        cos, sin = rotary(dummy, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]

    def invalidate(self) -> None:
        """Parameters moved to new memory (released and resumed): graphs captured before are stale."""
        self.generation += 1

    def allocate(self) -> None:
        """(Re)create an empty cache at its initial size; every slot's contents are gone."""
        self._cap = min(self._initial_len, self.max_len)
        shape = (self.max_slots, self.num_kv_heads, self._cap, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.generation += 1

    def release(self) -> None:
        """Drop the cache tensors (their memory goes back to the allocator); `allocate` before use."""
        self.k, self.v = [], []
        self._cap = 0
        self.generation += 1

    @property
    def capacity(self) -> int:
        return self._cap

    def ensure_capacity(self, length: int) -> None:
        """Grow the cache (doubling, up to the context) so that `length` positions fit."""
        if length <= self._cap:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the context of {self.max_len}")
        new_cap = min(self.max_len, max(length, self._cap * 2))
        pad = new_cap - self._cap
        self.k = [F.pad(k, (0, 0, 0, pad)) for k in self.k]
        self.v = [F.pad(v, (0, 0, 0, pad)) for v in self.v]
        self._cap = new_cap
        self.generation += 1

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (compaction)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    @torch.inference_mode()
    def prefill(self, slot: int, input_ids: list[int], start: int = 0, all_logits: bool = False,
                record: bool = False) -> torch.Tensor:
        """Run `input_ids` at positions start.. in `slot` (its cache before `start` is kept); `record`
        keeps the expert ids of every position in `recorded` (an MoE model).

        Returns the logits of the last position, shape [1, vocab], or of every position with
        `all_logits` (the LM head over a long prompt costs as much as the layers for real vocabularies).
        """
        n = len(input_ids)
        self.ensure_capacity(start + n)
        ids = torch.tensor([input_ids], device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        # query i (position start+i) sees cache positions 0..start+i
        mask = torch.arange(start + n, device=self.device)[None, :] <= positions[:, None]
        last = None if all_logits else torch.tensor([n - 1], device=self.device)
        logits = self._forward(ids, positions[None, :], slot, mask[None, None], start + n, last, record=record)
        return logits if last is not None else logits[0]

    @torch.inference_mode()
    def prefill_batch(self, first_slot: int, prompts: list[list[int]], record: bool = False) -> torch.Tensor:
        """Prefill prompts of any lengths into slots first_slot.. in one forward (one call of each
        op for the lot instead of one per prompt). Logits of each prompt's last token [n, vocab].

        Shorter prompts are padded at the end: their padding writes the cache past the prompt,
        where nothing reads before the sequence's own tokens overwrite it. `record`: as `prefill`
        (the rows past each prompt are its padding's).
        """
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        self.ensure_capacity(width)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device)
        mask = positions[None, :] <= positions[:, None]  # causal: real queries never see padding
        last = torch.tensor(lengths, device=self.device) - 1
        rows = positions[None, :].expand(len(prompts), width)
        return self._forward(ids, rows, first_slot, mask[None, None], width, last, record=record)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], record: bool = False) -> torch.Tensor:
        """One step for the sequences in slots 0..B-1: token i sits at positions[i]. Logits [B, vocab].
        `record`: their expert ids into `step_routes` (an MoE model)."""
        total = max(positions) + 1
        self.ensure_capacity(total)
        ids = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        return self._step(ids, pos, total, static=False, record=record)

    @torch.inference_mode()
    def decode_static(self, ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """The decode step over tensors only (no host sync, no allocation that depends on values):
        rows 0..B-1 of `ids`/`positions` [B] are slots 0..B-1, attending cache positions < `length`.
        Logits [B, vocab] in float32. An MoE model's expert ids always go to `step_routes` (a graph
        cannot choose per replay; a few ids per token beside the experts' matmuls)."""
        return self._step(ids, positions, length, static=True, record=True)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, length: int, static: bool, record: bool
              ) -> torch.Tensor:
        mask = torch.arange(length, device=ids.device)[None, :] <= positions[:, None]
        logits = self._forward(ids[:, None], positions[:, None], 0, mask[:, None, None, :], length, None,
                               static=static, record=record)[:, 0]
        if record and self.step_routes is not None and self.recorded is not None:
            self.step_routes[: ids.shape[0]].copy_(self.recorded[:, 0])
        return logits

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, first_slot: int, mask: torch.Tensor, total: int,
        last: torch.Tensor | None, static: bool = False, record: bool = False,
    ) -> torch.Tensor:
        """ids and positions [B, S] for slots first_slot.., mask [B, 1, S, total]. Logits [B, S, vocab],
        or [B, vocab] at the index `last` [B] of each row (the LM head only where it is needed).
        An MoE layer runs its experts `static`ally (`moe.dense`) or not; `record` keeps their ids in
        `recorded`."""
        b, s = ids.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, S, hd]
        rows = torch.arange(first_slot, first_slot + b, device=ids.device)[:, None]
        routes: list[torch.Tensor] = []
        for layer, k_cache, v_cache in zip(self.layers, self.k, self.v, strict=True):
            h = F.rms_norm(x, (x.shape[-1],), layer.ln1, self.eps)
            q = F.linear(h, layer.q, layer.q_bias).view(b, s, nh, hd)
            k = F.linear(h, layer.k, layer.k_bias).view(b, s, nkv, hd)
            v = F.linear(h, layer.v, layer.v_bias).view(b, s, nkv, hd)
            if layer.q_norm is not None:  # Qwen3: RMSNorm over each head before the rotary embedding
                q = F.rms_norm(q, (hd,), layer.q_norm, self.eps)
                k = F.rms_norm(k, (hd,), layer.k_norm, self.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
            # write this step's keys and values at their positions, then attend the slots' prefixes
            k_cache[rows, :, positions] = k.transpose(1, 2)
            v_cache[rows, :, positions] = v
            keys = k_cache[first_slot : first_slot + b, :, :total]
            values = v_cache[first_slot : first_slot + b, :, :total]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).reshape(b, s, nh * hd), layer.o)
            h = F.rms_norm(x, (x.shape[-1],), layer.ln2, self.eps)
            if layer.moe is not None and self.moe is not None:
                out, chosen = moe_forward(h, layer.moe, self.moe, self.act, static, self.graph_experts)
                x = x + out
                if record:
                    routes.append(chosen)
            else:
                x = x + F.linear(self.act(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)
        if routes:
            self.recorded = torch.cat(routes, dim=-1).to(torch.int32)  # [B, S, layers x k]
        if last is not None:
            x = x[torch.arange(b, device=x.device), last]
        return F.linear(F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps), self.lm_head).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
