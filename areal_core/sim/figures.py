"""Figures for docs/PLANNING.md (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path

from areal_core.sim.planner import Alternative, recommend


def plot_ratio(alternatives: list[Alternative], path: str | Path, title: str) -> Path:
    """Predicted throughput against the rollout:trainer split, one line per eta, the
    synchronous baseline as a horizontal line and the recommendation circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    asyn = [a for a in alternatives if a.mode == "async"]
    for eta in sorted({a.eta for a in asyn}):
        points = sorted((a.n_rollout_gpus / a.n_trainer_gpus, a.throughput) for a in asyn if a.eta == eta)
        ax.plot([p[0] for p in points], [p[1] / 1e3 for p in points], marker="o", label=f"async, eta {eta}")
    for a in alternatives:
        if a.mode == "sync":
            ax.axhline(a.throughput / 1e3, color="grey", linestyle="--", label="sync (all devices, in turn)")
    best = recommend(alternatives)
    if best.mode == "async":
        ax.plot(
            [best.n_rollout_gpus / best.n_trainer_gpus],
            [best.throughput / 1e3],
            "o",
            markersize=14,
            markerfacecolor="none",
            markeredgecolor="black",
            label="recommended",
        )
    ratios = sorted({a.n_rollout_gpus / a.n_trainer_gpus for a in asyn})
    ax.set_xscale("log")
    ax.set_xticks(ratios)
    ax.set_xticklabels([_ratio_label(alternatives, r) for r in ratios], rotation=0, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("rollout : trainer devices")
    ax.set_ylabel("effective training throughput (k tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ratio_label(alternatives: list[Alternative], ratio: float) -> str:
    for a in alternatives:
        if a.mode == "async" and a.n_rollout_gpus / a.n_trainer_gpus == ratio:
            return f"{a.n_rollout_gpus}:{a.n_trainer_gpus}"
    return f"{ratio:.2f}"
