"""Train: turning trajectories into better weights, correcting for the older policies that made them.

Owns:
- `advantages`, `losses`: pure functions of tensors with per-token masks — GRPO (with/without std),
  Dr.GRPO, REINFORCE++-baseline; PPO-clip (clip-higher, dual-clip), GSPO, CISPO; decoupled PPO's
  capped proximal/behaviour weight, token- and sequence-level truncated IS, outlier masking; KL
  (k1/k2/k3) in reward or loss; entropy bonus; token/sequence/group aggregation; off-policy metrics.
- `objective`: the configured composition of those (`train.loss` recipes and overrides).
- `batch`: `list[Trajectory]` -> padded tensors; bad trajectories skipped or truncated, counted.
- `backend` (the interface) and `torch_backend`: model, optimizer, device, micro-batching.
- `loop`: the continuous `Trainer` over a `BatchSource` (the buffer implements it), publishing
  through `sync`; `checkpoint`: save/resume with the opaque state of other parts; `build`:
  `build_trainer(config, source, engine_urls)`; `memory_source`: an in-memory `BatchSource`;
  `ranks`: several trainer ranks on one loop (rank 0 reads the buffer and publishes, the others
  follow over a gloo control group).
- `recorder`: what the trainer records for the dashboard at each step (trajectories with their
  advantages into `dashboard.store`, the buffer's books into `buffer.jsonl`).
- `synthetic`: made-up trajectories (random tokens, groups, rewards) for the trainer's tests and
  benchmarks.

Does not own: inference; how weights travel to engines (`sync`); which trajectories are ready or
too stale (`buffer`); starting processes (`launch`).
"""
