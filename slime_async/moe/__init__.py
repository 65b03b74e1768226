"""Mixture-of-experts models: what every part needs to agree on.

`shape.MoeShape` reads (and refuses, naming the field) a HF MoE config; `routing` is the routed-experts
record that travels from the engine to the trainer for routing replay.
"""
