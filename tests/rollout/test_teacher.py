"""On-policy distillation's teacher scoring against real engine processes over HTTP: exact logprobs
through SGLang's prompt scoring, batched, failed over; a teacher that is down or slow is counted and
never waited for."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch
from aiohttp import web
from helpers import PROMPTS

from slime_async.launch.process import EngineProcess
from slime_async.rollout.client import ServerError, SGLangClient
from slime_async.rollout.sinks import ListSink
from slime_async.rollout.teacher import TeacherScorer, TeacherSink
from slime_async.types import StopReason, Trajectory, Turn


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def reference_logprobs(reference: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """log p(token t | tokens before t) for t >= 1 under the HF model, [len(ids) - 1]."""
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    return np.array([logp[t - 1, ids[t]].item() for t in range(1, len(ids))], np.float32)


def turn(prompt: list[int], completion: list[int], new_branch: bool = False) -> Turn:
    n = len(completion)
    return Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * n, versions=[0] * n,
                new_branch=new_branch)


def trajectory(turns: list[Turn]) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", sample_index=0, turns=turns, stop_reason=StopReason.DONE)


async def test_score_is_the_models_logprob_of_each_token_in_one_batched_request(
        engines: list[EngineProcess], reference) -> None:
    sequences = [np.array(p, np.int32) for p in PROMPTS[:3]]
    starts = [1, 3, len(PROMPTS[2]) - 1]
    async with SGLangClient([engines[0].url]) as client:
        scores = await client.score(sequences, starts)
        assert client.stats.requests == 1  # one request for the whole batch
    for seq, start, got in zip(sequences, starts, scores, strict=True):
        expected = reference_logprobs(reference, seq.tolist())[start - 1:]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-4)


async def test_score_fails_over_from_a_dead_teacher(engines: list[EngineProcess], reference) -> None:
    dead = dead_url()
    seq = np.array(PROMPTS[1], np.int32)
    async with SGLangClient([dead, engines[1].url], backoff=0.01, unhealthy_after=1) as client:
        (got,) = await client.score([seq], [2])
        # the dead one is tried first (equally loaded: the first listed), then the request fails over
        assert client.servers[dead].healthy is False and client.stats.retries == 1
        assert client.stats.errors["ClientConnectorError"] == 1
    np.testing.assert_allclose(got, reference_logprobs(reference, seq.tolist())[1:], atol=1e-4)


async def test_scorer_fills_every_turn_of_a_multi_turn_and_branched_trajectory(
        engines: list[EngineProcess], reference) -> None:
    a, b, c = PROMPTS[3] + PROMPTS[1], PROMPTS[1], PROMPTS[2]  # 12, 5 and 2 tokens
    # turn 2 extends turn 1 (a tool reply then more completion); turn 3 starts a new branch
    turns = [turn(a[:4], a[4:7]), turn(a[7:9], a[9:]), turn(b[:3], b[3:], new_branch=True), turn(c, [])]
    traj = trajectory(turns)
    scorer = TeacherScorer(SGLangClient([e.url for e in engines]))
    async with scorer.client:
        sink = ListSink()
        await TeacherSink(sink, scorer).put([traj])
    assert sink.groups == [[traj]] and scorer.stats.outcomes == {"scored": 1}
    first = reference_logprobs(reference, a)  # entry t - 1 is token t's
    np.testing.assert_allclose(turns[0].teacher_logprobs, first[3:6], atol=1e-4)
    np.testing.assert_allclose(turns[1].teacher_logprobs, first[8:], atol=1e-4)
    np.testing.assert_allclose(turns[2].teacher_logprobs, reference_logprobs(reference, b)[2:], atol=1e-4)
    assert turns[3].teacher_logprobs is None  # it generated nothing
    assert scorer.stats.tokens == 3 + (len(a) - 9) + (len(b) - 3)


async def test_a_down_teacher_is_counted_and_the_group_goes_on_unscored(caplog: pytest.LogCaptureFixture) -> None:
    traj = trajectory([turn(PROMPTS[3][:3], PROMPTS[3][3:])])
    scorer = TeacherScorer(SGLangClient([dead_url()], retries=1, backoff=0.01, unhealthy_after=1))
    async with scorer.client:
        sink = ListSink()
        await TeacherSink(sink, scorer).put([traj])
        assert scorer.client.any_healthy is False
        again = trajectory([turn(PROMPTS[1][:3], PROMPTS[1][3:])])
        requests = scorer.client.stats.requests
        caplog.clear()
        await scorer.score([again])  # marked down: not asked at all (nor waited for) until it is healthy again
        assert scorer.client.stats.requests == requests
        assert not [r for r in caplog.records if "could not score" in r.getMessage()]  # no attempt was made
    assert sink.groups == [[traj]] and traj.turns[0].teacher_logprobs is None
    assert scorer.stats.outcomes == {"teacher_unavailable": 2}
    assert scorer.stats.summary(scorer.client)["teacher_unavailable"] == 2


@pytest.fixture
async def stuck_teacher():
    """A teacher that takes every request and never answers (a hung server)."""
    never = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    never.set()
    await runner.cleanup()


async def test_a_slow_teacher_times_out_is_retried_and_counted(stuck_teacher: str) -> None:
    traj = trajectory([turn(PROMPTS[3][:3], PROMPTS[3][3:])])
    scorer = TeacherScorer(SGLangClient([stuck_teacher], request_timeout=0.2, retries=1, backoff=0.01,
                                        unhealthy_after=5))
    async with scorer.client:
        await scorer.score([traj])
        with pytest.raises(ServerError):
            await scorer.client.score([np.array(PROMPTS[3], np.int32)], [1])
    assert traj.turns[0].teacher_logprobs is None
    assert scorer.stats.outcomes == {"teacher_unavailable": 1}
    stats = scorer.client.stats  # each call: one try, then a retry (the only server was just tried: it waits)
    assert stats.retries == 2 and stats.requests == stats.errors["TimeoutError"] == 2
