"""Mixture-of-experts models: what every part needs to agree on.

`shape.MoeShape` reads (and refuses, naming the field) a HF MoE config; `routing` is the routed-experts
record that travels from the engine to the trainer for routing replay; `replay` which of its rows a
trainer replays; `experts` the experts' SwiGLU MLPs as grouped matrix products (the Megatron backend
and the engine's eager step share it).
"""
