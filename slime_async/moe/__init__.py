"""Mixture-of-experts models: what every part needs to agree on.

`shape.MoeShape` reads (and refuses, naming the field) a HF MoE config; `routing` is the routed-experts
record that travels from the engine to the trainer for routing replay; `replay` says which recorded
rows a router may replay; `experts` the experts' SwiGLU MLPs as grouped matrix products (the Megatron
backend and the engine's eager step share it); `hf_layout` maps a Hugging Face checkpoint's per-expert
names onto the fused expert parameters of a loaded transformers model (the engine and the torch
backend both use it).
"""
