"""Train: turning trajectories into better weights.

Owns: losses and advantages (pure functions of tensors), the trainer loop, the backends (`torch`,
`megatron`), checkpoints, and the tiny local model that `slime-async init-model` makes
(`tiny_model`). Does not own: inference, or how weights reach the engines (that is `sync`).
Filled so far: `tiny_model`; the rest lands with the trainer issue.
"""
