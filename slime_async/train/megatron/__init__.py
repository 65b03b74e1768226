"""The `megatron` trainer backend: megatron-core's GPT model behind the `TrainerBackend` interface.

Owns: building a megatron-core `GPTModel` shaped like a HF Qwen2/Qwen3/Llama model (`model`), with
torch SDPA core attention when Transformer Engine is absent (`sdpa_attention`), and for Qwen3-MoE our
router (`moe_router`) and grouped experts (`grouped_experts`); loading and exporting
its weights in HF names across tensor/pipeline-parallel shards (`weights`, using the name and layout
mapping in `sync.megatron_names`); process groups (`parallel`); vocab-parallel logprobs and entropy
(`logprobs`); the optimizer step (`optimizer`: Megatron's DDP and optimizer on GPU, torch AdamW on
CPU); the pipeline schedule (`pipeline`); the backend itself (`backend.MegatronBackend`); and the
one CPU shim that lets CI run it all without a GPU (`cpu_compat`).

Does not own: losses (the `LossFn` it is handed), the loop, starting the processes of a multi-GPU
trainer (`launch`), or pushing weights to engines (`sync`).

Importing this package imports nothing of megatron-core; its modules do.
"""
