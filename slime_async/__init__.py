"""slime_async: an asynchronous, event-driven engine for agentic RL post-training of LLMs.

The parts, one sub-package each (see DESIGN.md for the contract between them): `types`,
`config`, `env`, `rollout`, `transport`, `buffer`, `train`, `sync`, `engine`, `launch`, `cli`.
"""

__version__ = "0.1.0"
