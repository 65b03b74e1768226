"""What each `engine.kind` is, in one place: the settings it can honour and the routes it speaks.

The config's checks (`Config`), the weight publisher (`sync`), the rollout client factory
(`rollout.engine_client`) and the launcher (`launch.local`) ask the kind's `EngineKind` instead of
testing `kind == "vllm"` each on their own. A new kind is one entry here plus its dialect's pieces
where the dialect is new (docs/architecture.md, "A new engine kind").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Dialect = Literal["sglang", "vllm"]
"""The HTTP API a server speaks: SGLang's (`/generate`, `/update_weights_from_*`) or vLLM's."""


@dataclass(frozen=True)
class EngineKind:
    name: str
    label: str
    """How messages name its servers ("vLLM")."""
    dialect: Dialect
    """Which rollout client talks to it and which weight routes the publisher uses."""
    sync_modes: tuple[str, ...]
    """The `sync.mode`s that reach it."""
    sync_note: str = ""
    """Why other modes do not (said in the refusal)."""
    release_memory: bool = True
    """Whether it can give its GPU memory back between updates (`sync.release_memory`)."""
    sglang_router: bool = True
    """Whether sglang-router can stand in front of it (it speaks SGLang's API)."""
    remote_admin: bool = True
    """Whether its weight routes take a token, so that it may listen off loopback."""
    routed_experts: bool = True
    """Whether it reports the experts each token was routed to (routing replay)."""
    version_route: str = "/get_model_info"
    """GET route whose JSON carries the served `weight_version`."""
    pause_route: str = "/pause_generation"
    pause_body: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({"mode": "in_place"}))
    """How a weight push pauses it: requests in flight stay where they are, with their KV cache."""
    abort_pause_route: str = "/pause_generation"
    abort_pause_body: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({"mode": "abort"}))
    """How a push pauses it under `rollout.partial_mode: abort`: requests in flight end with their partial
    output (finish reason `abort`), which the rollout client resends as the prompt of their rest."""
    resume_route: str = "/continue_generation"
    flush_route: str | None = "/flush_cache"
    """Route that drops cached prefixes (KV computed by earlier weights) once nothing runs; a push under
    `rollout.partial_mode: abort` calls it between the update and the resume. None: the push itself
    drops them (vLLM's `/reset_prefix_cache`)."""
    stale_prefixes_in_place: bool = False
    """Whether an update with requests paused in place leaves cached prefixes of the old weights for new
    requests to reuse. SGLang's radix cache does (it can be flushed only when nothing runs, and an
    engine under asynchronous RL never idles): the prefixes every request shares (system prompt, tools,
    a group's prompt, an episode's earlier turns) would be computed once by the first weights and
    reused under every later version's stamp. Such kinds default to `rollout.partial_mode: abort`."""
    version_stamp: MappingProxyType[str, Any] = field(
        default_factory=lambda: MappingProxyType({"abort_all_requests": False}))
    """Fields `/update_weight_version` takes besides `new_version`."""
    tied_head_by_name: bool = False
    """Whether a disk push must write a tied LM head out under its own name (vLLM's reload leaves it stale)."""
    lora_adapters: bool = False
    """Whether a LoRA run (`train.lora`) publishes the adapters themselves, which the engine loads and
    applies (vLLM's `/v1/load_lora_adapter`), instead of the merged weights of the adapted layers.
    vLLM's in-place reload reads whole checkpoints only, and adapters are a few percent of the bytes."""

    @property
    def default_partial_mode(self) -> Literal["in_place", "abort"]:
        """`rollout.partial_mode` when the config leaves it unset: `abort` where in-place pushes leave
        stale prefixes (`stale_prefixes_in_place`), else `in_place`."""
        return "abort" if self.stale_prefixes_in_place else "in_place"


ADAPTER_NAME = "policy"
"""The name an engine serves the trained LoRA adapters under: requests ask for it as their model."""


_SGLANG_MODES = ("tensor", "disk", "nccl")

ENGINE_KINDS: dict[str, EngineKind] = {
    "embedded": EngineKind("embedded", "embedded", "sglang", _SGLANG_MODES),
    "sglang": EngineKind("sglang", "SGLang", "sglang", _SGLANG_MODES, stale_prefixes_in_place=True),
    "vllm": EngineKind(
        "vllm", "vLLM", "vllm", ("disk",),
        sync_note="vLLM's own weight transfer is CUDA IPC or NCCL",
        release_memory=False, sglang_router=False, remote_admin=False, routed_experts=False,
        version_route="/weight_info", pause_route="/pause?mode=keep", pause_body=MappingProxyType({}),
        abort_pause_route="/pause?mode=abort", abort_pause_body=MappingProxyType({}),
        resume_route="/resume", flush_route=None, version_stamp=MappingProxyType({}), tied_head_by_name=True,
        lora_adapters=True,
    ),
}


def engine_kind(name: str) -> EngineKind:
    """The kind named `name`; a ValueError lists the kinds there are."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"engine.kind: {name!r} is not one of {', '.join(ENGINE_KINDS)}") from None
