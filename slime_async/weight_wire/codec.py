"""Named tensors as one `serialized_named_tensors` item of `/update_weights_from_tensor`, both ways.

An item is either a safetensors file (base64 in the JSON body; any host, the embedded engine only)
or SGLang's own pickled tensor handles (`shared_tensors`; the same GPU or host, what a real SGLang
server takes). The publisher (`sync`) encodes, the embedded engine (`engine`) decodes: this module
is the format they agree on.
"""

from __future__ import annotations

import base64

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from slime_async.weight_wire.shared_tensors import deserialize_shared, is_pickle


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file in memory holding `tensors` (moved to the CPU; tied weights copied apart,
    since safetensors refuses tensors that share storage)."""
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        plain[name] = t
    return save_safetensors(plain)


def encode_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """One `serialized_named_tensors` item: base64 of a safetensors file holding `tensors`."""
    return base64.b64encode(safetensors_bytes(tensors)).decode("ascii")


def decode_named_tensors(serialized: list[bytes] | list[str], shared_budget: int = 2**40,
                         shared_since: float = 0.0) -> dict[str, torch.Tensor]:
    """The tensors of every item (items already base64-decoded, or base64 strings). An item is
    either `encode_named_tensors`' safetensors file or SGLang's own pickled tensor handles
    (`shared_tensors`: at most `shared_budget` bytes each, of files made since `shared_since`); a
    ValueError names the bad item."""
    tensors: dict[str, torch.Tensor] = {}
    for i, item in enumerate(serialized):
        try:
            raw = base64.b64decode(item, validate=True) if isinstance(item, str) else item
        except ValueError as exc:
            raise ValueError(f"serialized_named_tensors[{i}]: not base64 ({exc})") from None
        if is_pickle(raw):
            tensors.update(deserialize_shared(raw, i, shared_budget, shared_since))
            continue
        try:
            tensors.update(load_safetensors(raw))
        except Exception as exc:
            raise ValueError(f"serialized_named_tensors[{i}]: not base64 of a safetensors file ({exc})") from None
    return tensors
