"""`bench e2e_gpu`'s code paths on CPU: its analysis of a real `slime-async train` run, its engine-alone
generation rows (hand-set and adaptive concurrency), and its `nvidia-smi` parsing. The bench itself
needs a GPU; what it computes from a run is checked here before it spends lent GPU time."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._engine_alone import generation_alone
from benchmarks._runs import run_training
from benchmarks.e2e_gpu import analyse, headline, parse_apps, parse_smi_line, summarise
from slime_async.types import Trajectory
from slime_async.types.codec import from_json

pytestmark = pytest.mark.slow


def test_smi_lines_parse_and_anything_else_is_skipped() -> None:
    when, util, gib = parse_smi_line("2026/12/06 06:20:11.250, 37, 55756\n")
    assert (util, round(gib, 3)) == (37.0, 54.449) and when % 1 == pytest.approx(0.25)
    assert parse_smi_line("timestamp, utilization.gpu [%], memory.used [MiB]") is None
    assert parse_smi_line("") is None
    assert parse_apps("919, 7520\n979, 20112\nNo running processes found\n") == {919: 7520.0, 979: 20112.0}


def test_a_real_run_is_analysed_and_summarised(tiny_model_dir: Path, tmp_path: Path) -> None:
    summary = run_training("configs/local.yaml", "e2e-cpu", tmp_path, [
        f"model.path={tiny_model_dir}", "warmstart.enabled=false", "warmstart.check_tasks=16",
        "warmstart.min_success=0", "train.steps=6", "data.eval_every=0", "rollout.batch_size=16",
        "rollout.filter_equal_rewards=false", "log.dashboard=false"])
    # a sample inside the run's steady steps, one outside it
    t0 = summary["records"][3]["time"] - summary["records"][3]["seconds"]
    smi = [(t0 + 0.01, 40.0, 1.0), (t0 - 1000, 100.0, 2.0)]
    r = analyse(summary, smi, {})
    assert r["steps"] == 6 and r["steady_steps"] == 3 and r["samples_per_s"] > 0
    assert r["gpu_busy"] == pytest.approx(0.4) and r["gpu_memory_peak_gib"] == 2.0
    assert set(r["split_s"]) == {"wait_s", "batch_s", "recompute_s", "train_s", "publish_s"}
    assert sum(r["split_s"].values()) <= r["steady_s"] + 1e-6  # the parts of the steady steps' time
    assert 0 < r["kept_fraction"] <= 1 and r["generated_tokens_per_s"] > 0
    runs = {f"tiny-eta{eta}": dict(r, eta=eta) for eta in (2, 0, 1, 4)}
    runs["tiny-eta2"] |= {"success_before": summary["success_before"]["sampled"],
                          "success_after": summary["success_after"]["sampled"]}
    generation = [{"concurrency": 8, "episodes_per_s": 10.0, "tokens_per_s": 100.0, "seconds": 1.0},
                  {"concurrency": 16, "episodes_per_s": 20.0, "tokens_per_s": 200.0, "seconds": 1.0},
                  {"concurrency": "adaptive", "episodes_per_s": 19.0, "tokens_per_s": 190.0, "seconds": 1.0}]
    d = summarise("tiny", runs, generation, 1.0, "cpu")
    assert d["best_hand_set"] == 16 and d["adaptive_vs_best"] == pytest.approx(0.95)
    assert all(run["vs_lockstep"] == pytest.approx(1.0) for run in d["runs"].values())
    bound = min(20.0 * r["kept_fraction"], d["train_alone_samples_per_s"])
    assert d["runs"]["tiny-eta2"]["of_bound"] == pytest.approx(r["samples_per_s"] / bound)
    assert d["train_alone_samples_per_s"] >= r["samples_per_s"]  # training alone is never slower than the loop
    assert len(d["rows"]) == 4 + 3
    line = headline({"device": "cpu", "shapes": {"tiny": d}})
    assert line.startswith("on cpu: tiny: async/lockstep 1.00x at eta 2") and "0.95x the best hand-set (16)" in line


def test_generation_alone_drives_one_engine_at_each_concurrency(tiny_model_dir: Path, tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    from benchmarks.adaptive_concurrency import headline as adaptive_headline
    from benchmarks.adaptive_concurrency import summarise as adaptive_summary

    rows = generation_alone(tiny_model_dir, tmp_path, "configs/local.yaml", groups=2, concurrencies=(4, 16),
                            overrides=["rollout.sampling.max_new_tokens=5"])
    assert [r["concurrency"] for r in rows] == [4, 16, "adaptive"]
    assert all(r["episodes"] == 16 and r["episodes_per_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # a hand-set row keeps its limit; the adaptive one moves between its floor (a group: 8) and ceiling (16)
    assert (rows[0]["limit_median"], rows[1]["limit_last"]) == (4, 16)
    assert 8 <= rows[2]["limit_median"] <= 16 and 8 <= rows[2]["limit_last"] <= 16
    shown = capfd.readouterr().out  # rollout's table says what limits the episodes in flight, and why
    assert "limit 4 (rollout.max_concurrency)" in shown and "(adaptive: from the engines' load)" in shown
    for row in rows:  # the overrides reached every row
        lines = (tmp_path / f"rollout-{row['concurrency']}.jsonl").read_text().splitlines()
        turns = [t for line in lines for t in from_json(line, Trajectory).turns]
        assert len(lines) == 16 and all(len(t.completion_ids) <= 5 for t in turns)
        assert any(t.finish_reason == "length" for t in turns)

    setting = adaptive_summary(rows)
    best = max(rows[:2], key=lambda r: r["episodes_per_s"])
    assert setting["best_hand_set"] == best["concurrency"]
    assert setting["adaptive_vs_best"] == pytest.approx(rows[2]["episodes_per_s"] / best["episodes_per_s"])
    line = adaptive_headline({"instant tools": setting, "slow tools": setting | {"adaptive_vs_best": 0.95}})
    assert line.endswith("(goal 0.9, met)") == (setting["adaptive_vs_best"] >= 0.9)
    assert f"0.95 with slow tools (best hand-set {best['concurrency']})" in line


def test_a_shape_run_in_parts_says_what_is_not_run_yet() -> None:
    # the first device call of a shape runs eta 2 alone: no lockstep, no engine-alone rows yet
    eta2 = {"eta": 2, "steps": 24, "steady_s": 10.0, "samples_per_s": 50.0, "generated_tokens_per_s": 5000.0,
            "kept_fraction": 0.5, "gpu_busy": None, "success_before": 0.3, "success_after": 0.8,
            "split_s": {"wait_s": 6.0, "batch_s": 0.1, "recompute_s": 0.1, "train_s": 3.0, "publish_s": 0.8}}
    d = summarise("0.5b", {"0.5b-eta2": eta2}, [], 1.0, "gpu") | {"failed": {"0.5b-eta0": "out of memory"}}
    assert d["runs"]["0.5b-eta2"]["vs_lockstep"] is None and d["runs"]["0.5b-eta2"]["of_bound"] is None
    assert d["adaptive_vs_best"] is None and d["rows"][0][-2:] == ["-", "-"]
    line = headline({"device": "gpu", "shapes": {"0.5b": d}})
    assert "async/lockstep not run at eta 2" in line and "+50.0 points (goal +40)" in line
    assert line.endswith("failed: 0.5b-eta0")
    assert "adaptive" not in line


def test_a_bench_stopped_by_sigterm_takes_its_training_run_with_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A device call's time limit sends SIGTERM: no part of the bench's `train` run may outlive it (on
    the GPU machine an orphan keeps its memory)."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys; from pathlib import Path; from benchmarks._runs import run_training; "
              f"run_training('configs/local.yaml', 'long', Path({str(tmp_path)!r}), "
              f"['model.path={tiny_model_dir}', 'warmstart.enabled=false', 'warmstart.check_tasks=0', "
              "'train.steps=100000', 'data.eval_every=0', 'log.dashboard=false'])")
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])

    def descendants() -> set[int]:  # the bench's process tree, from /proc's parent ids
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        found, frontier = set(), {bench.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
            found |= frontier
        return found

    tree: set[int] = set()
    for _ in range(1200):  # bounded: until the launcher and its parts (buffer, engine, trainer, rollout) run
        tree = descendants()
        if len(tree) >= 5:
            break
        assert bench.poll() is None, "the bench ended by itself"
        time.sleep(0.1)
    assert len(tree) >= 5, tree

    def alive() -> list[int]:  # of the tree, what still runs (a zombie has ended)
        running = []
        for pid in tree:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    running.append(pid)
            except OSError:
                continue
        return running

    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    for _ in range(300):  # the parts follow their launcher (bounded)
        if not alive():
            break
        time.sleep(0.1)
    assert alive() == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in alive()]


def test_the_engine_alone_rows_warm_start_when_no_run_did(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """`E2E_GPU_ETAS=` (the engine-alone rows alone, on a machine whose earlier warm-start is gone): the
    warm-start is made in a process of its own, into the cache entry `train` would use, then found there."""
    from benchmarks._engine_alone import warm_started

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = ["warmstart.stages=[]", "warmstart.examples=32", "warmstart.batch_size=16"]
    first = warm_started(tiny_model_dir, "configs/local.yaml", small)
    assert first.is_relative_to(tmp_path / "cache") and (first / "config.json").is_file()
    assert "warm-start trained" in capfd.readouterr().out
    assert warm_started(tiny_model_dir, "configs/local.yaml", small) == first
    assert "warm-start found in the cache" in capfd.readouterr().out
