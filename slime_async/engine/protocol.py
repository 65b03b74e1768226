"""Request bodies of SGLang's HTTP API that the embedded engine serves, with SGLang's field names.

The reference is SGLang 0.5.23: `sglang/srt/managers/io_struct.py` and the JSON contract of
`sglang/api/v1/api_types.py`; `tests/engine/test_conformance.py` checks every field here against
them. As in SGLang, unknown keys inside `sampling_params` are refused and unknown top-level keys of
`/generate` are ignored (sglang-router adds `model`). Fields SGLang defines that the embedded engine
does not implement are accepted only at their neutral value; any other value is a 400 that names
the field, so a request never silently means something else here than on SGLang.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PENDING_VERSION = "pending"
"""The weight version of a replacement engine the launcher started: it serves nothing (503) until the
trainer's weights arrive with a version (`server._awaiting_weights`)."""

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Selector = Literal["target", "draft", "all"]


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Control(msgspec.Struct, kw_only=True):
    """A control body. SGLang's `BaseReq` gives every one a `rid` and an `http_worker_ipc` (its
    multi-tokenizer routing): accepted, and without effect here, as on a one-tokenizer SGLang. Unknown
    keys are ignored, as SGLang's msgspec decoding of these bodies does (`extra_behavior="ignore"`)."""

    rid: str | None = None
    http_worker_ipc: str | None = None


class SamplingParams(_Body):
    """SGLang's `sampling_params` (sglang/srt/sampling/sampling_params.py).

    As in SGLang, `null` is any field's default (`__post_init__`). `max_new_tokens` alone keeps the
    difference: absent means 128, clamped to what the context has room for; `null` means up to the
    context's end; a number is checked against the context (`server._check`)."""

    max_new_tokens: Annotated[int, msgspec.Meta(ge=0)] | msgspec.UnsetType | None = msgspec.UNSET
    temperature: NonNegFloat | None = 1.0
    """0 is greedy."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = 1.0
    top_k: int | None = -1
    """-1 disables top-k; otherwise at least 1 (SGLang refuses 0 and other negatives)."""
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = 0.0
    stop: str | list[str] | None = None
    """Stop strings (at most 32): generation ends when one appears in the decoded tail; `text` is cut
    before it unless `no_stop_trim` (`output_ids` keep every generated token)."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    n: Annotated[int, msgspec.Meta(ge=1)] | None = 1
    sampling_seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    """Accepted and without effect, as in SGLang without deterministic inference."""
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    spaces_between_special_tokens: bool | None = True
    """Passed to the tokenizer's decode, as SGLang does (fast tokenizers ignore it)."""
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Stream an event every this many tokens (and at the end); default 1."""
    # SGLang's, not implemented here: refused unless neutral (see `unsupported_fields`)
    stop_regex: Any = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    custom_params: Any = None
    beam_width: Any = None
    watermark: Any = None
    choice: Any = None

    def __post_init__(self) -> None:
        for name, default in _DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)


_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "ignore_eos": False, "n": 1,
             "skip_special_tokens": True, "no_stop_trim": False, "spaces_between_special_tokens": True,
             "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}
"""SGLang's `SamplingParams.__post_init__`: what `null` means."""


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """`POST /generate`: one prompt (text or token ids) or a batch of them, each sampled `n` times.

    Batch fields as in SGLang: `text` a list, `input_ids` a list of lists, and `rid`,
    `sampling_params`, `return_logprob`, `logprob_start_len` either one value for every prompt or a
    list with one per prompt (`server.normalize` checks the shapes). Unknown keys are ignored.
    """

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    """A list of token ids, or a list of such lists (a batch); never a mix."""
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    """Where `input_token_logprobs` start in the prompt; -1 (default): none, only the output's."""
    stream: bool = False
    sampling_logprobs_mode: Literal["selected"] | None = None
    """Only SGLang's default is supported: the logprob of the sampled token (see `sampling`)."""
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    """Add the prompt's token ids to the reply (`prompt_token_ids`)."""
    routed_dp_rank: int | None = None
    """A data-parallel rank to route to: this engine has one, so only 0 (SGLang's range check)."""
    data_parallel_rank: int | None = None
    """SGLang's deprecated name of `routed_dp_rank`."""
    return_routed_experts: bool = False
    """Add `meta_info.routed_experts` to the finished reply: base64 of int32 [positions, layers, top_k],
    the experts each fed position was routed to (an MoE model; a dense one has none to report, and
    the key is left out, as SGLang leaves it out without `--enable-return-routed-experts`). One value
    for the whole batch, as in SGLang (`GenerateReqInput.__getitem__` hands it to every prompt)."""
    routed_experts_start_len: int = 0
    """The first position reported: the reply covers `[routed_experts_start_len, prompt + output - 1)`;
    0..the prompt's length (checked only when `return_routed_experts`, as SGLang's scheduler does)."""
    # SGLang's, not implemented here: refused unless neutral (see `unsupported_fields`)
    input_embeds: Any = None
    watermark: Any = None
    top_logprobs_num: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    image_data: Any = None
    mm_hashes: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    session_params: Any = None
    kv_hints: Any = None
    max_thinking_tokens: Any = None
    custom_logit_processor: Any = None
    images_config: Any = None
    return_sampling_mask: Any = None
    modalities: Any = None
    # in `io_struct.GenerateReqInput`, not in SGLang's JSON contract: FastAPI reads them all the same
    return_indexer_topk: Any = None
    return_entropy: Any = None
    return_bytes: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    positional_embed_overrides: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    mm_content_hashes: Any = None
    mm_processor_kwargs: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    video_config: Any = None
    use_audio_in_video: Any = None
    encoder_urls: Any = None
    lora_id: Any = None
    background: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None


# SGLang fields accepted for compatibility and without effect here: routing, logging and tracing hints.
IGNORED_GENERATE_FIELDS = frozenset(
    {"extra_key", "priority", "cache_salt", "require_reasoning", "routing_key", "session_id", "custom_labels",
     "conversation_id", "log_metrics", "no_logs", "external_trace_header", "received_time", "http_worker_ipc"}
)
_NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                     "min_new_tokens": 0}
UNSUPPORTED_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__[
    SamplingParams.__struct_fields__.index("stop_regex"):])
UNSUPPORTED_GENERATE_FIELDS = frozenset(GenerateReqInput.__struct_fields__[
    GenerateReqInput.__struct_fields__.index("input_embeds"):])


def unsupported_fields(req: GenerateReqInput) -> list[str]:
    """Paths of the SGLang features a request asks for that the embedded engine does not have."""
    found = {name for name in UNSUPPORTED_GENERATE_FIELDS if not _neutral(getattr(req, name))}
    params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    for sp in params:
        if sp is None:
            continue
        for name in UNSUPPORTED_SAMPLING_FIELDS:
            value = getattr(sp, name)
            if value != _NEUTRAL_SAMPLING.get(name) and value not in (None, [], {}):
                found.add(f"sampling_params.{name}")
    return sorted(found)


def _neutral(value: Any) -> bool:
    """SGLang's "not asked for": None, false, 0, empty, or a batch's list of those."""
    if isinstance(value, list) and value:
        return all(_neutral(v) for v in value)
    return value in (None, False, 0, [], {}, "")


class AbortReq(_Control, kw_only=True):
    """`/abort_request`: every request whose id starts with `rid` (SGLang's prefix match), or all.
    SGLang's HTTP handler reads only `rid` and `abort_all`; the other fields are its internal
    messages' and are accepted and ignored as there."""

    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None


class PauseGenerationReqInput(_Control, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Control, kw_only=True):
    torch_empty_cache: bool = True


class UpdateWeightFromDiskReqInput(_Control, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    keep_pause: bool = False
    torch_empty_cache: bool = False
    # Declared by SGLang 0.5.23 and read by none of its code: accepted and without effect, as there.
    is_async: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None
    """Tensor metadata for some of SGLang's load formats: refused unless absent."""


class UpdateWeightsFromTensorReqInput(_Control, kw_only=True):
    serialized_named_tensors: list[bytes]
    """Base64 strings: SGLang's pickled tensor handles (CUDA IPC; `weight_wire.shared_tensors`), which the
    embedded engine also takes, or base64 of a safetensors file (the embedded engine only). Typed as
    bytes so that msgspec decodes the base64 itself, in C, while parsing the body."""
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    """Which of SGLang's models (target, speculative draft, all): the embedded engine has no draft
    model, so "draft" is refused (`refused_update_fields`)."""
    torch_empty_cache: bool = False


class UpdateWeightVersionReqInput(_Control, kw_only=True):
    new_version: str
    abort_all_requests: bool = True


class ReleaseMemoryOccupationReqInput(_Control, kw_only=True):
    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None
    """What to give back; None or []: everything (SGLang's `GPU_MEMORY_ALL_TYPES`)."""


class ResumeMemoryOccupationReqInput(_Control, kw_only=True):
    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None


class InitWeightsUpdateGroupReqInput(_Control, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Control, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


def refused_update_fields(req: Any) -> list[str]:
    """The fields of a weight-update body that ask for what the embedded engine has not got."""
    found = []
    if getattr(req, "selector", "all") == "draft":
        found.append("selector: the embedded engine has no speculative draft model")
    if getattr(req, "manifest", None) is not None:
        found.append("manifest: not supported by the embedded engine (SGLang has it)")
    return found


def decode_body(data: bytes, type: type[Any]) -> Any:
    """Parse a JSON body as `type`; a ValueError whose message names the field on failure."""
    if not data.strip():
        data = b"{}"
    try:
        return msgspec.json.decode(data, type=type)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {type.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed JSON body: {exc}") from None
