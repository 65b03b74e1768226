"""Which rows of a routing record a trainer may replay; shared by the torch and Megatron routers.

A record comes from an engine (a message from another process): a row is replayed only when its k
ids are all experts of the model and distinct. Any other row (-1 for unreported, an id out of range,
a repeated id) is routed by the model itself, so no record can make a router index out of bounds.
"""

from __future__ import annotations

import torch


def usable_routes(rec: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[tokens] bool for `rec` [tokens, k]: rows of k in-range, distinct expert ids."""
    ok = ((rec >= 0) & (rec < num_experts)).all(dim=-1)
    srt = rec.sort(dim=-1).values
    return ok & (srt[:, 1:] != srt[:, :-1]).all(dim=-1)


def moved_rows(rec: torch.Tensor, own: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: usable rows of `rec` whose set of experts differs from the model's own top-k `own`
    (the `moe/route_mismatch` count)."""
    return (rec.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1) & usable
