"""Rollout: many concurrent multi-turn episodes on one asyncio loop per worker, against SGLang servers.

Owns: the SGLang client (`client`: aiohttp, sticky and least-loaded routing over many servers,
retries, failover, aborts, resuming requests that a weight update aborted) and its vLLM dialect
(`vllm_client`), the staleness
admission rule (`admission`), the scheduler (`scheduler`: groups of n, concurrency limit,
group filtering, accounting), the env's failures counted by name (`errors`), the guard that stops a
run that cannot learn (`guard`: most episodes fail, or no group has a learning signal) and the sinks
finished groups go to (`sinks`). Does not own: what
an episode does (`env`), the wire to the buffer (`transport`), training.
"""

from slime_async.rollout.admission import StalenessBudget
from slime_async.rollout.client import ServerError, ServerReply, SGLangClient
from slime_async.rollout.scheduler import HttpPolicy, RolloutStats, Scheduler
from slime_async.rollout.sinks import BufferSink, JsonlSink, ListSink, Sink
from slime_async.rollout.vllm_client import VLLMClient, engine_client

__all__ = [
    "BufferSink",
    "HttpPolicy",
    "JsonlSink",
    "ListSink",
    "RolloutStats",
    "SGLangClient",
    "Scheduler",
    "ServerError",
    "ServerReply",
    "Sink",
    "StalenessBudget",
    "VLLMClient",
    "engine_client",
]
