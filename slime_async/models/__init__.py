"""Models: the model directories this project makes itself.

Owns: the tiny local model (`tiny_model`: a BPE tokenizer trained here, a chat template with tools,
a random Qwen2 or Qwen3-MoE; presets `tiny`, `tiny-moe`, `small`, `100m`, `0.5b`; cached under
`~/.cache/slime_async/`), which `model.path: tiny` names and `slime-async init-model` writes.

Does not own: checking or loading a model directory (`config.model_dir`), training it (`train`) or
serving it (`engine`).
"""
