"""The embedded engine's core: continuous batching on one thread, weight updates between steps.

One thread owns the model. Each iteration it runs the control commands that arrived (weight
updates, pause, abort), admits waiting sequences into free cache slots (prefill), and runs one
decode step for every running sequence. Sequences join and leave between steps. Torch releases
the GIL in its kernels, so the HTTP server's event loop stays responsive beside it.

Every generated token records the weight version in effect when it was sampled, so a request
that spans an update reports SGLang's `weight_versions` spans exactly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slime_async.engine.graphs import make_decoder
from slime_async.engine.model import SlotModel
from slime_async.engine.protocol import SamplingParams
from slime_async.engine.sampling import sample
from slime_async.engine.weights import InPlaceCopier
from slime_async.moe.hf_layout import checkpoint_views
from slime_async.types.oom import is_out_of_memory

log = logging.getLogger(__name__)

SAMPLING_EPS = 1e-6
"""SGLang's `_SAMPLING_EPS`: a temperature below it samples greedily."""


@dataclass
class Sequence:
    """One sample being generated: its prompt, what it produced so far, and how it ended."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    on_update: Callable[[Sequence], None] | None = None
    """Called (on the engine thread) after each new token, for streaming."""
    on_finish: Callable[[Sequence], None] | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    stop_window: int = 1
    """Output tokens whose text a stop string is looked for in: SGLang's longest stop string in
    tokens, plus one (a stop string may start inside a token)."""
    input_logprob_start: int | None = None
    """SGLang's `logprob_start_len` when prompt logprobs are asked for (0..len(prompt)), else None."""
    input_logprobs: list[tuple[float | None, int]] | None = None
    """(logprob, token) from `input_logprob_start` on; the first logprob is None, as in SGLang."""
    routes_from: int | None = None
    """SGLang's `routed_experts_start_len` when routed experts are asked for (and the model has
    experts), else None: nothing is recorded for the sequence."""
    route_chunks: list[torch.Tensor] = field(default_factory=list)
    """Expert ids of the fed positions 0..cached-1 so far, on the device (int32 [n, layers x k] each)."""
    routed_experts: np.ndarray | None = None
    """When finished: int32 [prompt + output - 1 - routes_from, layers x k] (SGLang's rows)."""
    retractions: int = 0
    aborted_waiting: bool = False
    """Aborted while in the queue (SGLang answers those with a shorter `meta_info`)."""
    request: Any = None
    """What the server keeps of the request this sequence answers (the engine never reads it)."""
    slot: int | None = None
    cached: int = 0
    """Tokens of prompt + output whose keys and values are in the slot's cache."""
    created: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


class Engine:
    """Continuous-batching generation over a `SlotModel`; thread-safe entry points."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_batch_size: int = 32,
        context_length: int | None = None,
        seed: int = 0,
        weight_version: str = "0",
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.context_length = context_length or int(model.config.max_position_embeddings)
        self.slots = SlotModel(model, max_batch_size, self.context_length)
        self.moe = self.slots.moe
        """The experts' layout; None for a dense model (which never reports routed experts)."""
        self._map_weights()
        self.decoder = make_decoder(self.slots, cuda_graphs)
        """The decode step: eager on CPU, CUDA graphs per batch-size bucket on a GPU."""
        self.seed = seed
        self.generator = torch.Generator(device=self.slots.device).manual_seed(seed)
        self.weight_version = weight_version
        # SGLang stops on any of the model config's, the generation config's and the tokenizer's EOS
        # tokens (`ModelConfig` and `Req._check_token_based_finish`)
        self.eos_ids: set[int] = set()
        for eos in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None)):
            self.eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = int(model.config.vocab_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        self.released: set[str] = set()
        """Memory given back by `release_memory` (kv_cache, weights): nothing runs until it is resumed."""
        self.steps = 0
        self.generated_tokens = 0
        self.finished = 0
        self.aborted = 0
        self.busy_s = 0.0
        """Seconds the loop spent admitting and decoding (work in hand): with wall-clock time, the share
        of it the engine generated, for a run's time split (`/server_info`)."""
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future | None, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.errors = 0
        """Steps that failed (their requests were aborted with the error; the loop went on)."""
        self.fatal: str | None = None
        """Why the loop stopped for good (it ran out of memory: a retry would too); None while it runs."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called (on the engine thread) when the loop stops for good: the server exits with it."""
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # --- entry points (any thread) --------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; its `on_finish` is called on the engine thread when it ends."""
        self.call(lambda: self.waiting.append(seq))

    def call(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future | None:
        """Run `fn` on the engine thread between steps; with `loop`, return a future of its result."""
        future = loop.create_future() if loop is not None else None
        self._commands.put((fn, future, loop))
        self._wake.set()
        return future

    @property
    def alive(self) -> bool:
        """Whether the loop thread runs (`/health` says 503 otherwise)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --- the loop (engine thread) ---------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            self._run_commands()
            if self.paused or self.released or (not self.waiting and not self.running):
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            began = time.perf_counter()
            try:
                self._admit()
                if self.running:
                    self._decode()
            except Exception as exc:  # no request may stop the loop: what it held is aborted, it goes on
                if is_out_of_memory(exc):  # ... except memory: every next step would fail the same way
                    self._stop_for_memory(exc)
                    return
                log.exception("engine step failed; aborting the %d requests it held", len(self.running) +
                              len(self.waiting))
                for seq in [*self.running, *self.waiting]:
                    self._finish(seq, abort_reason(f"engine error: {exc!r}"))
                self.waiting.clear()
                self.errors += 1
            finally:
                self.busy_s += time.perf_counter() - began

    def _stop_for_memory(self, exc: BaseException) -> None:
        """Out of memory in a step: abort what is held with the reason, and stop the loop for good."""
        self.fatal = (
            f"engine: out of memory in a generation step on {self.slots.device.type} with {len(self.running)} "
            f"requests running and {len(self.waiting)} waiting (engine.max_batch_size {self.max_batch_size}, its "
            f"cache {self.slots.capacity} positions a slot of at most {self.context_length}): lower "
            f"engine.max_batch_size, or leave the engine more of the device (a trainer on the same GPU holds "
            f"the rest); {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        log.error("%s", self.fatal)
        held = [*self.running, *self.waiting]
        self.running.clear()  # first: their slots are not compacted (a copy on a device out of memory)
        self.waiting.clear()
        for seq in held:
            self._finish(seq, abort_reason(self.fatal))
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future, loop = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as exc:
                result, error = None, exc
            if future is not None and loop is not None:
                loop.call_soon_threadsafe(_resolve, future, result, error)

    def _admit(self) -> None:
        # slots stay compact: the running sequence i owns slot i (see `_vacate`)
        room = self.max_batch_size - len(self.running)
        if not self.waiting or room <= 0:
            return
        batch: list[Sequence] = []
        while self.waiting and len(batch) < room:
            seq = self.waiting[0]
            if seq.params.max_new_tokens == 0:  # SGLang's prefill-only request: scores, no token
                self.waiting.popleft()
                slot = len(self.running) + len(batch)
                if seq.input_logprob_start is not None:
                    self._prompt_logprobs(seq, slot)
                if seq.routes_from is not None:
                    self.slots.prefill(slot, seq.prompt, record=True)
                    seq.route_chunks = [self._recorded(0, len(seq.prompt))]
                self._finish(seq, {"type": "length", "length": 0})
                continue
            length = seq.length  # after a retract, re-prefill what was generated too
            # one forward pads every prompt to the longest: bound the padded size, not just the sum
            if batch and (len(batch) + 1) * max(length, max(s.length for s in batch)) > PREFILL_TOKENS:
                break
            batch.append(self.waiting.popleft())
        if not batch:
            return
        first = len(self.running)
        for i, seq in enumerate(batch):  # before the batch's prefill, which then rewrites the slots
            if seq.input_logprob_start is not None and seq.input_logprobs is None:
                self._prompt_logprobs(seq, first + i)
        record = any(s.routes_from is not None for s in batch)
        logits = self.slots.prefill_batch(first, [s.prompt + s.output for s in batch], record=record)
        for i, seq in enumerate(batch):
            seq.slot, seq.cached = first + i, seq.length
            if seq.routes_from is not None:  # a retracted sequence's earlier record is recomputed here
                seq.route_chunks = [self._recorded(i, seq.length)]
            self.running.append(seq)
        self._sample(batch, logits)

    def _prompt_logprobs(self, seq: Sequence, slot: int) -> None:
        """SGLang's `input_token_logprobs`: each prompt token's logprob given the tokens before it
        (plain log-softmax, no temperature), from `input_logprob_start` on. A second prefill of this
        one prompt with every position's logits: only requests that ask pay for it."""
        start = seq.input_logprob_start or 0
        if start >= len(seq.prompt):
            seq.input_logprobs = []
            return
        logits = self.slots.prefill(slot, seq.prompt, all_logits=True)
        targets = torch.tensor(seq.prompt[start + 1:], device=logits.device)
        scores = torch.log_softmax(logits[start:-1].float(), dim=-1).gather(1, targets[:, None])[:, 0].tolist()
        seq.input_logprobs = [(None, seq.prompt[start]), *zip(scores, seq.prompt[start + 1:], strict=True)]

    def _recorded(self, row: int, length: int) -> torch.Tensor:
        recorded = self.slots.recorded
        assert recorded is not None, "a recording forward leaves its expert ids"
        return recorded[row, :length]

    def _decode(self) -> None:
        batch = list(self.running)
        record = self.moe is not None and any(s.routes_from is not None for s in batch)
        logits = self.decoder.decode([s.output[-1] for s in batch], [s.length - 1 for s in batch], record)
        if record:  # copied: the next step (a replayed graph) rewrites the buffer
            step = self.slots.step_routes[: len(batch)].clone()
            for i, s in enumerate(batch):
                if s.routes_from is not None:
                    s.route_chunks.append(step[i : i + 1])
        for s in batch:
            s.cached = s.length
        self.steps += 1
        self._sample(batch, logits)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        params = [s.params for s in batch]
        vocab = logits.shape[-1]
        # per-row parameters stay on the CPU: `sample` reads its branch flags there (no device sync).
        # As SGLang does: a temperature under 1e-6 is greedy (1e-45 would divide the logits into
        # infinities), and a top_k past the vocabulary is no top-k (it would not fit a tensor).
        tokens, logprobs = sample(
            logits,
            torch.tensor([p.temperature if p.temperature >= SAMPLING_EPS else 0.0 for p in params]),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.top_k if p.top_k < vocab else -1 for p in params]),
            torch.tensor([p.min_p for p in params]),
            self.generator,
        )
        # one device-to-host transfer per step (token ids are exact in float64)
        token_list, logprob_list = torch.stack([tokens.double(), logprobs.double()]).tolist()
        for seq, token, logprob in zip(batch, token_list, logprob_list, strict=True):
            token = int(token)
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            self.generated_tokens += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            elif seq.on_update is not None:
                seq.on_update(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        """SGLang's order (`Req.update_finish_state`): a stop string, then a stop token or EOS (both
        off under `ignore_eos`), then the length budget."""
        p = seq.params
        if p.stop:
            # SGLang: the stop string anywhere in the decoded tail of (its length in tokens + 1)
            tail = self.tokenizer.decode(seq.output[-seq.stop_window:])
            for stop in [p.stop] if isinstance(p.stop, str) else p.stop:
                if stop in tail:  # "" is in every text: it stops at once, as in SGLang
                    return {"type": "stop", "matched": stop}
        if not p.ignore_eos and (token in self.eos_ids or (p.stop_token_ids and token in p.stop_token_ids)):
            return {"type": "stop", "matched": token}
        if len(seq.output) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if seq.length >= self.context_length:
            return {"type": "length", "length": len(seq.output)}
        return None

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        if seq.routes_from is not None:
            seq.routed_experts = _routes_of(seq)
            seq.route_chunks = []
        self.finished += 1
        self.aborted += reason["type"] == "abort"
        if seq in self.running:
            self._vacate(seq)
        seq.slot = None
        if seq.on_finish is not None:
            seq.on_finish(seq)

    def _vacate(self, seq: Sequence) -> None:
        """Remove a running sequence; the last one moves into its slot, so slots stay 0..B-1 and a
        decode step reads the cache as one slice (moving one slot's prefix is cheaper than
        gathering every slot's cache at every step)."""
        last = self.running.pop()
        if last is not seq:
            index = self.running.index(seq)
            self.slots.move(last.slot, index, last.cached)
            last.slot = index
            self.running[index] = last

    # --- control (run on the engine thread through `call`) --------------------------------

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Finish matching sequences now with finish_reason abort; they keep their partial output.

        As SGLang's scheduler: every request whose id starts with `rid` (the samples of an n > 1
        request and the prompts of a batch carry it as a prefix); an empty `rid` matches nothing
        unless `abort_all`."""
        if not abort_all and not rid:
            return 0
        victims = [s for s in [*self.running, *self.waiting] if abort_all or s.rid.startswith(rid)]
        for seq in victims:
            if seq in self.waiting:  # SGLang's `_handle_abort_req`: type and message only
                self.waiting.remove(seq)
                seq.aborted_waiting = True
                self._finish(seq, {"type": "abort", "message": "Abort in waiting queue"})
            else:
                self._finish(seq, abort_reason())
        return len(victims)

    def pause(self, mode: str) -> int:
        """SGLang's three modes: abort (return partial outputs), retract (re-queue), in_place."""
        self.paused = True
        if mode == "abort":
            return self.abort(abort_all=True)
        if mode == "retract":
            retracted = list(self.running)
            for seq in reversed(retracted):
                self.running.remove(seq)
                seq.slot, seq.cached = None, 0
                seq.retractions += 1
                self.waiting.appendleft(seq)
            return len(retracted)
        return len(self.running)

    def resume(self) -> None:
        self.paused = False

    def release_memory(self, tags: list[str] | None) -> None:
        """SGLang's `/release_memory_occupation`: give the KV cache and/or the weights' device memory
        back (for a trainer sharing the GPU). Like SGLang, only an idle engine, or one paused with
        nothing running (mode retract), may do it. Weights move to CPU memory and come back unchanged
        on resume (SGLang keeps them only with `enable_weights_cpu_backup`; the trainer pushes new ones
        after a resume either way)."""
        tags = set(tags or MEMORY_TAGS)
        if self.running:
            raise ValueError(f"release_memory_occupation needs an idle engine: {len(self.running)} requests are "
                             "running (pause_generation with mode retract first)")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.slots.release()
        if "weights" in tags and "weights" not in self.released:
            self.model.to("cpu")  # parameters keep their identity, but not their memory
            self._map_weights()
        self.decoder.release()  # recorded graphs hold the old addresses and their own memory pool
        self.released |= tags & {"kv_cache", "weights"}
        _empty_device_cache(self.slots.device)

    def resume_memory(self, tags: list[str] | None) -> None:
        """SGLang's `/resume_memory_occupation`: take back what `release_memory` gave."""
        tags = set(tags or MEMORY_TAGS)
        if "weights" in tags and "weights" in self.released:
            self.model.to(self.slots.device)
            self.slots.invalidate()
            self._map_weights()
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.slots.allocate()
        self.released -= tags
        self._wake.set()

    def _map_weights(self) -> None:
        """The tensors an update may name, and its copier. Tied weights answer to both names
        (lm_head.weight and model.embed_tokens.weight). An MoE model's experts answer to their
        checkpoint names (`model.layers.N.mlp.experts.E.gate_proj.weight`, as SGLang, vLLM and our
        weight wire send them) as views into transformers' fused parameters: views of the memory
        the parameters hold now, so the map is rebuilt when the weights move (release/resume)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if self.moe is not None:
            params |= {name: view for name, view in checkpoint_views(self.model).items() if name not in params}
        self._params = params
        self._copy_in = InPlaceCopier(params)

    def load_weights(self, tensors: dict[str, torch.Tensor], version: str | None) -> int:
        """Copy named tensors (HF names) into the model, all or nothing; set the version.

        Every name and shape is checked before the first copy, so a bad update changes nothing.
        """
        self._copy_in(tensors)
        if any(t.is_cuda for t in tensors.values()):
            # the sender may reuse shared (CUDA IPC) memory as soon as we answer: finish reading it
            torch.cuda.synchronize()
        if version is not None:
            self.weight_version = version
        return len(tensors)

    def set_version(self, version: str) -> None:
        self.weight_version = version


PREFILL_TOKENS = 8192
"""Most padded tokens in one batched prefill forward (bounds its activation memory)."""

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's GPU memory types (`GPU_MEMORY_ALL_TYPES`); the embedded engine's CUDA graphs are dropped
by any release (they are recorded again at the next step)."""


def _routes_of(seq: Sequence) -> np.ndarray | None:
    """SGLang's rows of a finished sequence: positions [routes_from, length - 1) (the last token is
    never fed), or None when its record does not reach that far (a step failed)."""
    if not seq.route_chunks or seq.aborted_waiting:  # SGLang's reply to a request aborted in its queue has none
        return None
    start, end = seq.routes_from or 0, seq.length - 1
    fed = sum(len(c) for c in seq.route_chunks)
    if fed < end:
        log.warning("request %s: routed experts of %d positions recorded, %d needed; none returned",
                    seq.rid, fed, end)
        return None
    return torch.cat(seq.route_chunks)[start:end].cpu().numpy()


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def abort_reason(message: str = "Aborted") -> dict[str, Any]:
    """SGLang's `FINISH_ABORT(...).to_json()`. A status code would turn the reply into an HTTP error
    in SGLang's tokenizer manager; the embedded engine's aborts keep their partial output (200)."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """SGLang's `weight_versions`: [{version, start, end}] runs over the output tokens (end exclusive)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans
