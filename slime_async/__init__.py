"""slime_async: an asynchronous, event-driven engine for agentic RL post-training of LLMs.

The parts, one sub-package each (docs/architecture.md is the contract between them and the map of
what each owns): `types`, `config`, `env`, `agents`, `data`, `evaluation`, `rollout`, `transport`,
`buffer`, `train`, `sync`, `weight_wire`, `engine`, `moe`, `models`, `rundir`, `launch`, `dashboard`,
`sim`, `cli`.
"""

__version__ = "0.1.0"
