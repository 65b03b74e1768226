"""The simulator against reality: the stored async_vs_sync runs (benchmarks/results), re-simulated from
their measured costs. Calibrated on the two runs without the latency tail, checked on the seven with it."""

from slime_async.sim.validate import TOLERANCE, validate


def test_simulation_matches_the_real_async_vs_sync_runs() -> None:
    v = validate(seeds=6, iters=12)
    for kind, eta, n, real, sim in v.configurations():
        assert abs(sim / real - 1) <= TOLERANCE, f"{kind} eta {eta} ({n} runs): real {real:.1f}, sim {sim:.1f} s"
    for c in v.checks:
        assert c.sim_max_staleness == c.real_max_staleness, c
    assert len(v.held_out()) == 7
    # the asynchronous speed-up itself, the figure users ask for, lands near the measured 3.07x at eta 4
    cfg = {(k, e): (real, sim) for k, e, _, real, sim in v.configurations()}
    real_speedup = cfg["tail", 0][0] / cfg["tail", 4][0]
    sim_speedup = cfg["tail", 0][1] / cfg["tail", 4][1]
    assert abs(sim_speedup / real_speedup - 1) <= 2 * TOLERANCE, (real_speedup, sim_speedup)
