"""Weights into a vLLM server in place, from the version's safetensors file (disk mode).

vLLM 0.32's routes for this (`VLLM_SERVER_DEV_MODE=1`, which the launcher sets): `POST /pause?mode=keep`
freezes the requests in flight where they are (their KV cache is kept), `POST /collective_rpc
{method: reload_weights, kwargs: {weights_path}}` has every worker load the directory's
checkpoint into the live parameters, `POST /reset_prefix_cache` drops cached prefixes computed
with the old weights, `POST /update_weight_version {new_version}` stamps the tokens generated from
now on, and `POST /resume` lets the frozen requests go on.

A request that spans an update is not split: its answer's `weight_versions` says which tokens each
version produced (`[{version: "4", start: 0, end: 90}, {version: "5", start: 90, end: 600}]`),
exactly as SGLang's in-place updates report it, so the trainer's per-token staleness and
off-policy corrections see the truth. The frozen requests keep the KV cache of their earlier tokens
(computed with the old weights), as with SGLang's in-place mode.

Why disk: vLLM's own weight-transfer engines (`/init_weight_transfer_engine`, `/update_weights`)
are CUDA IPC and NCCL only, and these machines have neither; a file on local disk of the tiny
model is written in about a millisecond and reloaded in a few (`slime-async bench engines_cpu`).
A model with tied embeddings gets its LM head written
out by name (`with_tied_head`: vLLM's reload leaves a tied head stale otherwise). An engine whose push
fails half-way stays paused (the publisher retries the whole push, then
resumes it), so no token comes from half-loaded weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def with_tied_head(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The weights with `lm_head.weight` written out when the model ties it to the embedding.

    A tied model's parameters name the shared tensor once (as the embedding). vLLM 0.32's in-place
    reload then updates the embedding but leaves its LM head on the old values (greedy output
    differs from HF's; `tests/vllm/test_vllm_client.py` pins it): given the head by name, it loads it.
    A copy, since safetensors refuses two names for one storage.
    """
    names = {name for name, _ in named}
    if EMBED in names and HEAD not in names:
        embed = next(t for name, t in named if name == EMBED)
        return [*named, (HEAD, embed.detach().clone())]
    return named


async def vllm_push_disk(publisher: Any, url: str, path: Path, version: int) -> None:
    """Load `path` (a directory with the version's `model.safetensors`) into the vLLM at `url`.

    Leaves the engine paused (`publisher.pause`: the publisher resumes it once the whole push is done).
    """
    await publisher.pause(url)  # its kind's pause: `/pause?mode=keep`
    await publisher.post(url, "/collective_rpc",
                         {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
    await publisher.post(url, "/reset_prefix_cache", {})
    await publisher.post(url, "/update_weight_version", {"new_version": str(version)})
