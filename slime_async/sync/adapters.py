"""LoRA adapters to engines that load them (`EngineKind.lora_adapters`: vLLM), instead of merged weights.

A LoRA run (`train.lora`) changes only its adapters. An engine that applies adapters itself gets
them, in peft's format (the format SGLang's and vLLM's loaders read, and the one `train.lora` saves
checkpoints in): per version a directory `v<N>/` with `adapter_model.safetensors` (tensors named
`base_model.model.<module>.lora_A.weight` / `lora_B`) and `adapter_config.json`, written so that a
reader finds all of it or nothing (`disk.write_version`).

vLLM 0.32 (started by the launcher with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, the
zero adapters loaded under `ADAPTER_NAME` before any request): `POST /pause?mode=keep`, then `POST
/v1/load_lora_adapter {lora_name, lora_path, load_inplace: true}` replaces the adapter's weights
under the same name (a new path each version: vLLM warns that prefix-cache blocks of the same path
survive a reload), `POST /reset_prefix_cache` drops prefixes computed with the old adapter, `POST
/update_weight_version` stamps the tokens from now on, and the publisher resumes it. Requests ask
for the adapter by name (`model`), so every token comes from base + adapter.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from slime_async.config.engine_kinds import ADAPTER_NAME
from slime_async.config.schema import LoraConfig
from slime_async.sync.disk import write_version
from slime_async.sync.push import Engines, NamedWeights, Prepared

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""peft's names for a causal LM's adapters: `base_model.model.<module path>.lora_A.weight`."""


def adapter_config(rank: int, alpha: float, targets: list[str], base_model: str) -> dict[str, object]:
    """peft's `adapter_config.json` for these adapters (what SGLang's and vLLM's loaders read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True}


async def prepare_adapters(pub: Engines, weights: NamedWeights, version: int, root: Path, lora: LoraConfig,
                           base_model: str) -> Prepared:
    """Write `version`'s adapters once (`weights` yields them under peft's names); returns the
    per-engine push, the bytes, 1."""
    def write() -> tuple[Path, int]:
        named = list(weights())
        if not named or not all(name.startswith(PEFT_PREFIX) and ".lora_" in name for name, _ in named):
            raise ValueError("sync: a LoRA push to adapter-loading engines needs the adapters (peft names), "
                             f"got {named[0][0] if named else 'nothing'!r}")
        config = json.dumps(adapter_config(lora.rank, lora.alpha, lora.target_modules, base_model), indent=2)
        path = write_version(root, version, named, weights_file=ADAPTER_WEIGHTS, extra={ADAPTER_CONFIG: config})
        return path, sum(t.numel() * t.element_size() for _, t in named)

    path, nbytes = await asyncio.to_thread(write)

    async def push(url: str) -> None:
        await pub.pause(url)  # its kind's pause: requests in flight stay, with their KV cache
        await pub.post(url, "/v1/load_lora_adapter",
                       {"lora_name": ADAPTER_NAME, "lora_path": str(path.resolve()), "load_inplace": True})
        await pub.post(url, "/reset_prefix_cache", {})
        await pub.post(url, "/update_weight_version", {"new_version": str(version)})

    return push, nbytes, 1
