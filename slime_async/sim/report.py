"""Plots (png, matplotlib) and the tables of docs/scaling.md, from simulation results."""

from __future__ import annotations

from pathlib import Path

from slime_async.sim.scenarios import Point


def scale_plot(points: list[Point], path: Path) -> None:
    """Throughput (trajectories/s and tokens/s) and staleness against GPUs, bottleneck per point."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    gpus = [p.gpus for p in points]
    traj_s = [p.result.buffer["trained"] / p.result.wall_s for p in points]
    tok_s = [p.result.trained_tokens / p.result.wall_s for p in points]
    mean_stale = [sum(k * v for k, v in p.result.train_staleness.items())
                  / max(1, sum(p.result.train_staleness.values())) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].loglog(gpus, traj_s, "o-", base=2)
    axes[0].set(xlabel="GPUs", ylabel="trained trajectories / s", title="throughput")
    for g, y, p in zip(gpus, traj_s, points, strict=True):
        axes[0].annotate(p.result.bottleneck(), (g, y), fontsize=7, rotation=20)
    axes[1].loglog(gpus, [t / 1e6 for t in tok_s], "o-", base=2)
    axes[1].set(xlabel="GPUs", ylabel="trained tokens / s (millions)", title="tokens")
    axes[2].semilogx(gpus, mean_stale, "o-", base=2, label="mean")
    axes[2].semilogx(gpus, [p.result.max_staleness for p in points], "s--", base=2, label="max")
    axes[2].set(xlabel="GPUs", ylabel="versions", title="staleness at training")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def areal_plot(sync: Point, points: list[Point], path: Path, goal: float) -> None:
    """Async/sync speed-up against eta, with AReaL's figure as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.eta for p in points], [sync.step_s / p.step_s for p in points], "o-", label="simulated, this design")
    ax.axhline(goal, color="gray", linestyle="--", label=f"AReaL's {goal}x")
    ax.set(xlabel="eta (max staleness)", ylabel="speed-up over sync (colocated)", title="AReaL's setting, 128 GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
