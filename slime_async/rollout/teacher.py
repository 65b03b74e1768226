"""On-policy distillation's rollout half: a teacher model scores the tokens the student sampled.

Each finished group, on its way to the buffer, has every trajectory's completion tokens scored by the
teacher server through SGLang's prompt scoring (`SGLangClient.score`: the whole sequence as the
prompt, `logprob_start_len` at its first completion token, `max_new_tokens` 0), in batched requests
off the trainer (here, in the rollout worker's event loop, concurrent with its episodes). The scores
land on each `Turn.teacher_logprobs`, as behaviour logprobs do; the trainer turns them into a
per-token reverse-KL term (`train.objective`).

A teacher that is slow or down must never hold the run back: each request has its timeout and
retries (the client's, with failover between teacher servers), a teacher marked down is not waited
for at all, and a group it could not score goes on unscored, counted as `teacher_unavailable`; its
tokens train without the KL term. Works for any env, black-box agents included: it only reads tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from slime_async.rollout.client import ServerError, SGLangClient
from slime_async.rollout.sinks import Sink
from slime_async.types import Trajectory, Turn

log = logging.getLogger(__name__)


@dataclass
class TeacherStats:
    """What the teacher did for this worker: trajectories scored or not, and the requests it took."""

    outcomes: Counter = field(default_factory=Counter)
    """`scored`, `teacher_unavailable` (down, slow or wrong: trained without the KL term)."""
    tokens: int = 0
    """Completion tokens scored."""
    seconds: float = 0.0
    """Time spent in scoring requests (summed over concurrent ones)."""

    def summary(self, client: SGLangClient) -> dict[str, object]:
        return {**{k: int(v) for k, v in self.outcomes.items()}, "tokens": self.tokens,
                "requests": client.stats.requests, "retries": client.stats.retries,
                "errors": dict(client.stats.errors), "seconds": round(self.seconds, 3)}


class TeacherScorer:
    """Fills `Turn.teacher_logprobs` of trajectories from a teacher server; never raises for the
    teacher's failures (they are counted)."""

    def __init__(self, client: SGLangClient, max_batch: int = 16, max_in_flight: int = 4) -> None:
        self.client = client
        self.max_batch = max_batch
        self._slots = asyncio.Semaphore(max_in_flight)
        self.stats = TeacherStats()

    async def score(self, trajectories: list[Trajectory]) -> None:
        """Score every trajectory (in place); a chunk the teacher could not score stays unscored."""
        pieces = [(t, *piece) for t in trajectories for piece in _pieces(t)]
        chunks = [pieces[i:i + self.max_batch] for i in range(0, len(pieces), self.max_batch)]
        results = await asyncio.gather(*(self._chunk(chunk) for chunk in chunks))
        failed = {id(p[0]) for chunk, ok in zip(chunks, results, strict=True) if not ok for p in chunk}
        scored = {id(p[0]) for p in pieces}
        for t in trajectories:
            if id(t) not in scored:
                continue  # nothing generated: nothing to score
            if id(t) in failed:
                for turn in t.turns:  # all or nothing per trajectory: a half-scored one trains no KL term
                    turn.teacher_logprobs = None
                self.stats.outcomes["teacher_unavailable"] += 1
            else:
                self.stats.outcomes["scored"] += 1

    async def _chunk(self, chunk: list[tuple[Trajectory, list[Turn], np.ndarray, int]]) -> bool:
        if not self.client.any_healthy:  # marked down: its health check brings it back; no wait meanwhile
            return False
        loop = asyncio.get_running_loop()
        async with self._slots:
            began = loop.time()
            try:
                scores = await self.client.score([ids for _, _, ids, _ in chunk], [start for *_, start in chunk])
            except (ServerError, ValueError) as exc:  # ValueError: a teacher that refused the request (4xx)
                log.warning("teacher could not score %d sequences: %s", len(chunk), exc)
                return False
            finally:
                self.stats.seconds += loop.time() - began
        for (_, turns, _, start), lps in zip(chunk, scores, strict=True):
            _assign(turns, start, lps)
            self.stats.tokens += sum(len(t.completion_ids) for t in turns)
        return True


class TeacherSink:
    """A sink that has the teacher score each group before handing it to `inner` (the buffer)."""

    def __init__(self, inner: Sink, scorer: TeacherScorer) -> None:
        self.inner = inner
        self.scorer = scorer

    async def put(self, group: list[Trajectory]) -> None:
        await self.scorer.score(group)
        await self.inner.put(group)

    async def close(self) -> None:
        await self.inner.close()


def _pieces(traj: Trajectory) -> list[tuple[list[Turn], np.ndarray, int]]:
    """Each sequence of `traj` (`Trajectory.segments`: a new one at every `new_branch` turn) that has
    completion tokens: its turns, its token ids, and the position of its first completion token."""
    segments: list[list[Turn]] = []
    for i, t in enumerate(traj.turns):
        if not segments or (t.new_branch and i > 0):
            segments.append([])
        segments[-1].append(t)
    out = []
    for turns in segments:
        ids = np.concatenate([a for t in turns for a in (t.prompt_ids, t.completion_ids)])
        pos, first = 0, None
        for t in turns:
            pos += len(t.prompt_ids)
            if len(t.completion_ids) and first is None:
                first = pos
            pos += len(t.completion_ids)
        if first is not None and first >= 1:  # token 0 has nothing before it to be scored from
            out.append((turns, ids, first))
    return out


def _assign(turns: list[Turn], start: int, logprobs: np.ndarray) -> None:
    """Give each turn of a sequence the teacher's logprobs of its completion tokens (`logprobs[j]`
    belongs to position `start + j`)."""
    pos = 0
    for t in turns:
        pos += len(t.prompt_ids)
        n = len(t.completion_ids)
        if n:
            t.teacher_logprobs = logprobs[pos - start:pos - start + n].copy()
        pos += n
