"""A campaign's decision for people: a table with each setting's outcome and paired difference to the
baseline (95 % intervals), a forest plot of the differences, and the learning curves with bands."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from areal_core.run.campaign import run_dir_of, still_unclear
from areal_core.run.decide import Interval
from areal_core.storage.fsutil import write_text_atomic

CURVE_KEYS = ("reward", "accuracy")


def markdown(decision: dict, plots: dict[str, str]) -> str:
    """The decision as a Markdown page (the campaign's UI artifact and ``decision.md``)."""
    d = decision
    final = d.get("final", True)  # (decisions written before the flag are final ones)
    lines = [
        f"# Campaign decision{'' if final else ' so far'}: {d['outcome_label']}",
        "",
        (
            f"Baseline **{d['baseline']}**; {_seeds(d)}, paired by seed; 95 % Student-t "
            f"intervals; a difference is clear once its interval excludes 0 or lies within +-{d['margin']:g}."
        ),
        (
            f"{'Stopped: ' + d['stopped_because'] if final else 'Running: ' + still_unclear(d)}. Runs trained {d['runs_trained']}, "
            f"reused {d['runs_reused']} (code {(d['code'].get('commit') or '?')[:10]}"
            f"{'+changes' if d['code'].get('changes') else ''})."
        ),
        "",
        "| setting | seeds | outcome, mean [95 % CI] | difference to baseline [95 % CI] | verdict |",
        "|---|---|---|---|---|",
    ]
    for s in d["settings"]:
        o, diff = s["outcome"], s["difference"]
        lines.append(f"| {s['label']} | {o['n']} | {_iv(o)} | {'-' if diff is None else _iv(diff)} | {s['verdict']} |")
    lines += [""] + [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def _seeds(d: dict) -> str:
    """How many seeds the settings ran: one number where all ran the same, else the range (the baseline
    and the settings unclear longest ran the most)."""
    ns = {s["outcome"]["n"] for s in d["settings"]}
    if len(ns) == 1:
        return f"{ns.pop()} seed(s) per setting"
    return f"{min(ns)}-{max(ns)} seeds per setting (a seed more of the baseline and the unclear settings only)"


def _iv(i: dict) -> str:
    return Interval(i["mean"], i["lo"], i["hi"], i["n"]).text()


def forest_plot(decision: dict, path: Path) -> None:
    """Each setting's paired difference to the baseline with its interval, zero and the margin marked."""
    rows = [s for s in decision["settings"] if s["difference"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 0.6 * len(rows) + 1.4))
    m = decision["margin"]
    ax.axvspan(-m, m, color="0.9")
    ax.axvline(0, color="0.4", lw=1)
    for y, s in enumerate(reversed(rows)):
        d = s["difference"]
        lo, hi = (d["lo"], d["hi"]) if math.isfinite(d["lo"]) else (d["mean"], d["mean"])
        ax.errorbar(d["mean"], y, xerr=[[d["mean"] - lo], [hi - d["mean"]]], fmt="o", capsize=4)
    ax.locator_params(axis="x", nbins=5)  # (more ticks crowd a narrow axis)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{s['label']} ({s['verdict']})" for s in reversed(rows)])
    ax.set_xlabel(f"difference to {decision['baseline']}:\n{decision['outcome_label']}")  # (two lines: it fits)
    # the key above the axes (a legend inside would cover an interval that reaches its corner)
    ax.set_title(f"shaded: within +-{m:g}, the same; bars: 95 % intervals", fontsize=8, loc="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves_plot(decision: dict, out_dir: Path, path: Path) -> None:
    """Per step, each setting's mean batch reward and accuracy over its seeds, with a 95 % band."""
    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(5.2 * len(CURVE_KEYS), 3.4))
    for s in decision["settings"]:
        frames = []
        for seed in s["by_seed"]:
            f = run_dir_of(out_dir, s["label"], int(seed)) / "metrics.parquet"
            if f.is_file():
                frames.append(pd.read_parquet(f, columns=["step", *CURVE_KEYS]))
        if not frames:
            continue
        both = pd.concat(frames)
        for ax, key in zip(axes, CURVE_KEYS):
            by_step = both.groupby("step")[key].apply(list)
            ivs = [Interval.of(v) for v in by_step]
            mean = [i.mean for i in ivs]
            lo = [i.lo if math.isfinite(i.lo) else i.mean for i in ivs]
            hi = [i.hi if math.isfinite(i.hi) else i.mean for i in ivs]
            ax.plot(by_step.index, mean, label=f"{s['label']} ({len(frames)} seeds)")
            ax.fill_between(by_step.index, lo, hi, alpha=0.2)
    for ax, key in zip(axes, CURVE_KEYS):
        ax.set_title(f"batch {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_decision_report(out_dir: str | Path) -> str:
    """``decision.md``, ``forest.png`` and ``curves.png`` in ``out_dir`` from its ``decision.json``;
    returns the Markdown."""
    out_dir = Path(out_dir)
    decision = json.loads((out_dir / "decision.json").read_text())
    forest_plot(decision, out_dir / "forest.png")
    curves_plot(decision, out_dir, out_dir / "curves.png")
    text = markdown(decision, {"differences to the baseline": "forest.png", "learning curves": "curves.png"})
    write_text_atomic(str(out_dir / "decision.md"), text)
    return text
