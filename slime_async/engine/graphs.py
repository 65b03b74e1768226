"""The decode step as the engine calls it: eager on CPU, replayed CUDA graphs on a GPU.

A decode step of a small model on a GPU is bound by kernel launches (hundreds per step, each a
few microseconds of CPU), not by the GPU. A CUDA graph records the launches of one step once and
replays them with one call. Graphs need fixed shapes and addresses, so `GraphDecoder` keeps one
graph per batch-size bucket over `SlotModel.decode_static`: the batch is padded up to the bucket
(padded rows write into free slots, which a later prefill overwrites), inputs are copied into
static buffers, and attention runs over the whole cache capacity with a mask. Graphs are dropped
when the cache or the weights move to new memory (`SlotModel.generation`); in-place weight
updates keep the addresses, so graphs survive them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from slime_async.engine.model import SlotModel

Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]
"""Records a step function; returns (replay, output tensor that each replay rewrites)."""


class Decoder(Protocol):
    def decode(self, tokens: list[int], positions: list[int], record: bool = False) -> torch.Tensor:
        """Logits [B, vocab] for the sequences in slots 0..B-1: token i at positions[i]. With `record`,
        an MoE model's expert ids are in `SlotModel.step_routes[:B]` after it."""
        ...

    def release(self) -> None:
        """Free what the decoder holds beside the model and cache (recorded graphs)."""
        ...


class EagerDecoder:
    """Each step runs op by op with the batch's own shapes (attention up to the longest sequence)."""

    def __init__(self, slots: SlotModel) -> None:
        self.slots = slots

    def decode(self, tokens: list[int], positions: list[int], record: bool = False) -> torch.Tensor:
        return self.slots.decode(tokens, positions, record)

    def release(self) -> None:
        pass


def default_buckets(max_slots: int) -> list[int]:
    """Batch sizes that get a graph: powers of two to 16, then steps of 16, and `max_slots`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_slots]
    sizes += list(range(16, max_slots, 16))
    return [*sizes, max_slots]


class GraphDecoder:
    """Replays one captured static step per batch-size bucket."""

    def __init__(self, slots: SlotModel, capture: Capture, buckets: list[int] | None = None) -> None:
        self.slots = slots
        self.buckets = sorted(buckets or default_buckets(slots.max_slots))
        if self.buckets[-1] < slots.max_slots:
            raise ValueError(f"buckets {self.buckets} must reach max_slots={slots.max_slots}")
        self._capture = capture
        size = self.buckets[-1]
        self.inputs = torch.zeros(2, size, dtype=torch.long, device=slots.device)
        """Row 0: token ids, row 1: positions; one host-to-device copy per step fills both."""
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self._generation = -1
        self.captures = 0
        """Graphs recorded so far (each bucket once per cache size)."""

    def release(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if not self._graphs:
            return
        self._graphs.clear()
        # Once the last graph of a memory pool is gone, torch frees the pool, and a capture into its
        # old handle fails (an internal assert in the caching allocator): the next ones take a new pool.
        new_pool = getattr(self._capture, "new_pool", None)
        if new_pool is not None:
            new_pool()

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], record: bool = False) -> torch.Tensor:
        # every graph writes an MoE model's expert ids into `step_routes` (`decode_static`)
        n = len(tokens)
        self.slots.ensure_capacity(max(positions) + 1)
        if self._generation != self.slots.generation:
            self._drop()
            self._generation = self.slots.generation
        b = self.bucket(n)
        pad = b - n
        # padded rows: token 0 at position 0 of the free slots n..b-1
        self.inputs[:, :b].copy_(torch.tensor([tokens + [0] * pad, positions + [0] * pad]))
        entry = self._graphs.get(b)
        if entry is None:
            # the inputs already hold this step: recording runs it once more on the same values,
            # so the cache rows it writes are the ones this step writes anyway
            ids, pos, length = self.inputs[0, :b], self.inputs[1, :b], self.slots.capacity
            entry = self._capture(lambda: self.slots.decode_static(ids, pos, length))
            self._graphs[b] = entry
            self.captures += 1
        replay, out = entry
        replay()
        return out[:n]


def eager_capture(step: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in for `cuda_capture` that runs the step at each replay (tests the plumbing on CPU)."""
    out = step()

    def replay() -> None:
        out.copy_(step())

    return replay, out


class CudaCapture:
    """Records a step into a CUDA graph; every graph shares one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def new_pool(self) -> None:
        """Record into a fresh pool from now on (call once every graph of the current one is dropped)."""
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        # warm up on a side stream first (lazy cuBLAS/attention setup must not be recorded)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the HTTP thread beside the engine thread may touch CUDA (it must not
        # invalidate this capture)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        return graph.replay, out


def make_decoder(slots: SlotModel, cuda_graphs: bool = True) -> Decoder:
    """CUDA graphs on a CUDA device (unless turned off), the eager step elsewhere."""
    if cuda_graphs and slots.device.type == "cuda":
        return GraphDecoder(slots, CudaCapture())
    return EagerDecoder(slots)
