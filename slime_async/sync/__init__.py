"""Sync: getting the trainer's weights into every inference engine, in place, with their version.

Owns: publishing named weights (HF names) to engines over SGLang's HTTP API (`publisher`) in three
modes, one module each — `tensor` (`/update_weights_from_tensor`, bucketed to `sync.bucket_mb`),
`disk` (`/update_weights_from_disk`, safetensors written atomically; vLLM's reload, `vllm`) and
`nccl` (`/init_weights_update_group` + `/update_weights_from_distributed`, for GPU fleets), which
see the publisher through `push.Engines` — with retries; the routes of each engine kind come from
`config.engine_kinds`, the wire format from `weight_wire`; the pause/continue protocol that makes a
bucketed push all-or-nothing; the weight version on the wire (the decimal number of optimizer steps)
and finding engines that missed an update (`/get_model_info`) to bring them up to date; the HF <->
Megatron-core mapping of weight names and layouts (`megatron_names`: fused QKV per query group,
fused gate/up, padded vocabulary, sharding).

Does not own: the optimizer or which weights to send (`train`), starting or restarting engines
(`launch`), or how the rollout side learns the version (it reads the engines' `weight_version`:
this is how a new version reaches the scheduler's admission control).
"""

from slime_async.sync.publisher import PublishReport, PushError, WeightPublisher

__all__ = ["PublishReport", "PushError", "WeightPublisher"]
