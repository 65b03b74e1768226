"""The trajectory store: what the trainer writes is what the dashboard reads, filtered and paged,
while the writer is still open (a second connection, as the dashboard's process has)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from slime_async.dashboard.store import Filters, StoreError, TrajectoryStore, TrajectoryWriter
from slime_async.train.recorder import advantages_of
from slime_async.types import StopReason, Trajectory, Turn


def trajectory(tok, task: str, group: str, index: int, reward: float, reply: str, version: int,
               stop: StopReason = StopReason.DONE) -> Trajectory:
    prompt = tok.encode(f"<|im_start|>user\nWhat is {task}?<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode(reply)
    turn = Turn(prompt_ids=prompt, completion_ids=out, logprobs=[-0.5] * len(out), versions=[version] * len(out),
                loss_mask=[1] * (len(out) - 1) + [0])
    return Trajectory(task_id=task, group_id=group, sample_index=index, turns=[turn], stop_reason=stop,
                      reward=reward, rewards={"correct": reward}, env="envs.calculator:CalculatorEnv")


@pytest.fixture
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_what_is_written_is_read_back_filtered_and_paged(tmp_path: Path, tok) -> None:
    writer = TrajectoryWriter(tmp_path, tok)
    store = TrajectoryStore(tmp_path)
    step1 = [trajectory(tok, "2+3", "g1", i, float(i % 2), f"The answer is {4 + i % 2}.", 0) for i in range(4)]
    writer.append(1, step1, advantages_of(step1, "grpo"))
    assert store.count() == 4  # seen by another connection while the writer is open
    step2 = [trajectory(tok, "7*8", "g2", i, 0.0, "I do not know", 0, StopReason.TRUNCATED) for i in range(4)]
    writer.append(2, step2, advantages_of(step2, "grpo"), trained_from=1)
    assert store.count() == 8
    assert store.count(Filters(stop_reason="truncated")) == 4
    assert store.count(Filters(reward_min=0.5)) == 2
    assert store.count(Filters(text="7*8")) == 4 and store.count(Filters(text="ANSWER IS 5")) == 2
    assert store.count(Filters(step_min=2, task_id="2+3")) == 0
    first = store.page(limit=3)
    assert [r["step"] for r in first] == [2, 2, 2] and len(store.page(offset=6, limit=3)) == 2
    best = store.page(sort="reward", limit=1)[0]
    assert best["reward"] == 1.0 and best["advantage"] > 0
    _, traj, texts = store.get(best["id"])
    assert traj.id == best["id"] and texts[0][1].startswith("The answer is 5")
    np.testing.assert_array_equal(traj.turns[0].loss_mask[-1:], [0])
    pieces = store.pieces({int(i) for i in traj.turns[0].completion_ids})
    assert "".join(pieces[int(i)] for i in traj.turns[0].completion_ids) == texts[0][1]
    # staleness of trained tokens: step 2 trained version-0 tokens on version-1 weights
    trained = [sum(int(t.turns[0].loss_mask.sum()) for t in step) for step in (step1, step2)]
    assert store.staleness() == {0: trained[0], 1: trained[1]}
    assert [len(store.group(g)) for g in ("g1", "g2")] == [4, 4]
    assert store.facets()["stop_reasons"] == {"done": 4, "truncated": 4}
    # a trainer back from its checkpoint at version 1 trains step 2 again: its rows go
    assert writer.roll_back(1) == 4 and store.count() == 4 and store.staleness() == {0: trained[0]}
    writer.close()
    store.close()


def test_grpo_advantages_are_the_trainers(tok) -> None:
    ts = [trajectory(tok, "1+1", "a", i, r, "2", 0) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    ts += [trajectory(tok, "1+2", "b", i, 1.0, "3", 0) for i in range(2)]
    adv = advantages_of(ts, "grpo")
    assert adv[0] == pytest.approx(1.5, rel=1e-4) and adv[1] == pytest.approx(-0.5, rel=1e-4)
    assert adv[4:] == [0.0, 0.0]  # equal rewards in a group: no signal
    assert advantages_of(ts, "dr_grpo")[:2] == pytest.approx([0.75, -0.25])


def test_a_file_that_is_not_a_store_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "trajectories.sqlite").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(StoreError, match=r"trajectories.sqlite: not a trajectory store"):
        TrajectoryStore(tmp_path).count()
    with pytest.raises(StoreError, match="no trajectory store"):
        TrajectoryStore(tmp_path / "elsewhere").count()
    with pytest.raises(StoreError, match="sort"):
        TrajectoryStore(tmp_path).page(sort="bogus")


def test_routing_records_are_not_kept_for_viewing(tmp_path: Path, tok) -> None:
    traj = trajectory(tok, "2+3", "g1", 0, 1.0, "The answer is 5.", 0)
    t = traj.turns[0]
    t.routed_experts = np.zeros((len(t.prompt_ids) + len(t.completion_ids)) * 8, np.uint8)
    writer = TrajectoryWriter(tmp_path, tok)
    writer.append(1, [traj], [1.0])
    _, back, _ = TrajectoryStore(tmp_path).get(traj.id)
    assert back.turns[0].routed_experts is None and np.array_equal(back.turns[0].completion_ids, t.completion_ids)
    assert t.routed_experts is not None  # the trainer's own copy keeps its record
    writer.close()
