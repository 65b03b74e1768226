"""Cluster simulator: a whole run on paper, driven by this system's own scheduling code.

Owns: the discrete-event simulation (`cluster`: engines under continuous batching, episodes with
tool calls, the buffer, the trainer's loop, weight sync), cost models (`costs`) fitted from this
project's measurements (`fit`: benchmarks/results/*.json, a run's own metrics), the episode
distributions (`workload`), and the studies built on them (`scenarios`: validation against the real
async_vs_sync runs, AReaL's setting, scale curves; `report`: plots and docs/scaling.md).

Does not own: any scheduling rule. Admission, the equal-rewards filter, the buffer (groups,
staleness eviction, sampling policy) and the trainer's consumption rule are the real ones, imported
from `rollout`, `buffer` and mirrored from `train.loop`; change them there and the simulation follows.
"""

from slime_async.sim.cluster import Cluster, Plan, SimResult, simulate
from slime_async.sim.costs import DecodeCost, IngestCost, SyncCost, TrainerCost
from slime_async.sim.workload import Lengths, Workload

__all__ = ["Cluster", "DecodeCost", "IngestCost", "Lengths", "Plan", "SimResult", "SyncCost", "TrainerCost",
           "Workload", "simulate"]
