"""Engine: the embedded inference server, SGLang's HTTP API over a torch model.

Owns: continuous batching with a KV-cache slot per sequence (`core`, `model`), sampling and its
logprob semantics (`sampling`), SGLang's request bodies (`protocol`) and endpoints (`server`),
in-place weight updates between decode steps with per-token weight versions, and starting a
server (`launch`, `slime-async serve`). Does not own: anything SGLang-specific beyond its HTTP
API, deciding when weights change (that is `sync`), or scheduling episodes (that is `rollout`).
"""
