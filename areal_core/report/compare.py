"""Compare finished runs: a markdown report with tables and PNG plots (pandas + matplotlib).

Input: run folders written by ``areal_core.run.setup.run_experiment`` (``summary.json``,
``metrics.parquet``, ``ledger.parquet``, ``config.json``), optionally with checkpoint
evaluations under ``<run>/evals/v<N>/summary.json`` (``areal_core.eval.harness``).
Output, in ``out_dir`` (a folder or fsspec URL), every file written atomically:

* ``report.md``: the comparison table, evaluation table, and the plots;
* ``report.csv``: one row per run (eta, objective, final_accuracy,
  effective_train_tokens_per_s, wall_time_s, steps, ...);
* ``learning_curve.png``, ``accuracy.png``, ``answer_lengths.png``,
  ``staleness.png``, ``throughput.png``.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from areal_core.storage.fsutil import filesystem, join, write_bytes_atomic, write_text_atomic

PLOTS = ("learning_curve", "accuracy", "answer_lengths", "staleness", "throughput")
CSV_COLUMNS = [
    "run",
    "eta",
    "objective",
    "final_accuracy",
    "accuracy_before",
    "accuracy_gain",
    "effective_train_tokens_per_s",
    "wall_time_s",
    "rl_time_s",
    "steps",
    "max_staleness_observed",
    "answer_len_p50",
    "answer_len_p90",
    "ledger_ok",
]


class ReportError(ValueError):
    """A run folder lacks what the report needs."""


@dataclass
class RunData:
    label: str
    url: str
    summary: dict
    metrics: pd.DataFrame
    ledger: pd.DataFrame
    config: dict = field(default_factory=dict)
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)  # version, bench, accuracy (pass@1), n


def eval_dir_for_run(run_url: str, version: int) -> str:
    """Where the evaluation of a run's checkpoint ``version`` belongs (read by :func:`load_run`)."""
    return join(str(run_url), "evals", f"v{version}")


def eval_dir_for_checkpoint(checkpoint_url: str) -> str:
    """``<run>/checkpoints/vN`` -> ``<run>/evals/vN``; ``<store>/vN`` -> ``<store>/evals/vN``."""
    parent, _, leaf = checkpoint_url.rstrip("/").rpartition("/")
    if not re.fullmatch(r"v\d+", leaf) or not parent:
        raise ValueError(f"{checkpoint_url}: not a checkpoint version URL (<store>/v<N>); give out_dir")
    root = parent.rpartition("/")[0] if parent.rsplit("/", 1)[-1] == "checkpoints" else parent
    return join(root, "evals", leaf)


def _label(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _read(url: str) -> bytes:
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise ReportError(f"{url}: not found (is this a finished run folder?)") from None


def _read_evals(run_url: str) -> pd.DataFrame:
    """One row per (checkpoint version, bench) from ``<run>/evals/v<N>/summary.json``."""
    fs, root = filesystem(join(run_url, "evals"))
    if not fs.exists(root):
        return pd.DataFrame(columns=["version", "bench", "accuracy", "n"])
    rows = []
    for entry in sorted(fs.ls(root, detail=False)):
        m = re.fullmatch(r"v(\d+)", entry.rstrip("/").rsplit("/", 1)[-1])
        if not m or not fs.exists(f"{entry}/summary.json"):
            continue
        summary = json.loads(fs.cat_file(f"{entry}/summary.json"))
        for bench, s in summary.get("benchmarks", {}).items():  # areal_core.eval.harness's summary
            rows.append(
                {"version": int(m.group(1)), "bench": bench, "accuracy": float(s["pass@1"]), "n": s["n_problems"]}
            )
    return pd.DataFrame(rows, columns=["version", "bench", "accuracy", "n"])


def load_run(url: str, label: str | None = None) -> RunData:
    summary = json.loads(_read(join(url, "summary.json")))
    metrics = pd.read_parquet(io.BytesIO(_read(join(url, "metrics.parquet"))))
    ledger = pd.read_parquet(io.BytesIO(_read(join(url, "ledger.parquet"))))
    fs, cfg_path = filesystem(join(url, "config.json"))
    config = json.loads(fs.cat_file(cfg_path)) if fs.exists(cfg_path) else {}
    return RunData(label or _label(url), url, summary, metrics, ledger, config, _read_evals(url))


def run_table(runs: list[RunData]) -> pd.DataFrame:
    """One row per run; ``final_accuracy`` is the run's held-out accuracy after RL."""
    rows = []
    for r in runs:
        s = r.summary
        la = s.get("answer_length_after", {})
        rows.append(
            {
                "run": r.label,
                "eta": s["eta"],
                "objective": s["objective"],
                "final_accuracy": s["accuracy_after"],
                "accuracy_before": s["accuracy_before"],
                "accuracy_gain": s["accuracy_after"] - s["accuracy_before"],
                "effective_train_tokens_per_s": s["effective_train_tokens_per_s"],
                "wall_time_s": s["wall_time_s"],
                "rl_time_s": s.get("rl_time_s"),
                "steps": s["steps"],
                "max_staleness_observed": s.get("max_staleness_observed"),
                "answer_len_p50": la.get("p50"),
                "answer_len_p90": la.get("p90"),
                "ledger_ok": bool(s.get("ledger_check", {}).get("ok")),
            }
        )
    return pd.DataFrame(rows, columns=CSV_COLUMNS)


def eval_table(runs: list[RunData]) -> pd.DataFrame:
    frames = [r.evals.assign(run=r.label) for r in runs if len(r.evals)]
    if not frames:
        return pd.DataFrame(columns=["run", "version", "bench", "accuracy", "n"])
    df = pd.concat(frames, ignore_index=True)
    return df[["run", "version", "bench", "accuracy", "n"]].sort_values(["run", "bench", "version"])


# -- plots ---------------------------------------------------------------------
def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _smooth(s: pd.Series, n: int) -> pd.Series:
    return s.rolling(max(1, n // 15), min_periods=1).mean()


def _integer_ticks(*axes: Axes) -> None:
    """Steps, versions and staleness are whole numbers: no 2.5 on their axes."""
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_learning_curve(runs: list[RunData]) -> Figure:
    fig = Figure(figsize=(10, 4))
    ax_r, ax_a = fig.subplots(1, 2)
    for r in runs:
        m = r.metrics
        ax_r.plot(m["step"], _smooth(m["reward"], len(m)), label=r.label)
        ax_a.plot(m["step"], _smooth(m["accuracy"], len(m)), label=r.label)
    ax_r.set(title="mean reward per batch (smoothed)", xlabel="step", ylabel="reward")
    ax_a.set(title="batch accuracy (smoothed; on the prompts drawn)", xlabel="step", ylabel="accuracy")
    ax_r.legend(fontsize=8)
    _integer_ticks(ax_r, ax_a)
    return fig


def plot_accuracy(runs: list[RunData]) -> Figure:
    """Held-out accuracy before -> after per run as arrows on an axis zoomed to the values (bars
    from 0 would hide a change of 0.01), each labelled with its gain; checkpoint evaluations."""
    fig = Figure(figsize=(10, 4))
    ax_b, ax_e = fig.subplots(1, 2)
    before = [r.summary["accuracy_before"] for r in runs]
    after = [r.summary["accuracy_after"] for r in runs]
    for i, (b, a) in enumerate(zip(before, after)):
        ax_b.annotate(
            "",
            xy=(i, a),
            xytext=(i, b),
            arrowprops={"arrowstyle": "->", "lw": 1.5, "color": "tab:green" if a >= b else "tab:red"},
        )
        ax_b.plot([i], [b], "o", color="tab:gray")
        ax_b.text(i + 0.08, a, f"{a - b:+.3f}", va="center", fontsize=8)
    lo, hi = min(before + after), max(before + after)
    pad = max(0.02, 0.15 * (hi - lo))
    ax_b.set_xlim(-0.5, len(runs) - 0.5)
    ax_b.set_xticks(list(range(len(runs))), [r.label for r in runs], rotation=20, fontsize=8)
    ax_b.set(
        title="held-out accuracy before (dot) -> after RL (arrow tip)",
        ylabel="accuracy",
        ylim=(max(0.0, lo - pad), min(1.0, hi + pad)),
    )
    any_eval = False
    for r in runs:
        for bench, group in r.evals.groupby("bench"):
            g = group.sort_values("version")
            ax_e.plot(g["version"], g["accuracy"], marker="o", label=f"{r.label} {bench}")
            any_eval = True
    ax_e.set(title="checkpoint evaluations", xlabel="checkpoint version", ylabel="accuracy")
    _integer_ticks(ax_e)
    if any_eval:
        ax_e.legend(fontsize=8)
    else:
        ax_e.text(
            0.5,
            0.5,
            "no checkpoint evaluations\n(see the report's text for why)",
            ha="center",
            va="center",
            transform=ax_e.transAxes,
        )
    return fig


def length_bins(lengths: pd.Series, max_bins: int = 30) -> np.ndarray:
    """Bin edges on half-integers, each bin a whole number of tokens wide: integer lengths
    binned at fractional edges give alternating empty and double bins (a spiky histogram)."""
    lo, hi = int(lengths.min()), int(lengths.max())
    width = max(1, -(-(hi - lo + 1) // max_bins))
    return np.arange(lo, hi + width + 1, width) - 0.5


def plot_answer_lengths(runs: list[RunData]) -> Figure:
    fig = Figure(figsize=(10, 4))
    ax_t, ax_h = fig.subplots(1, 2)
    every = pd.concat([r.ledger["n_tokens"] for r in runs])
    bins = length_bins(every) if len(every) else 10
    for r in runs:
        m = r.metrics
        (line,) = ax_t.plot(m["step"], _smooth(m["answer_len_mean"], len(m)), label=f"{r.label} mean")
        ax_t.plot(m["step"], _smooth(m["answer_len_p90"], len(m)), ls="--", color=line.get_color())
        ax_h.hist(r.ledger["n_tokens"], bins=bins, histtype="step", label=r.label)
    ax_t.set(title="trained answer length (solid: mean, dashed: p90)", xlabel="step", ylabel="tokens")
    ax_h.set(title="trained answer length distribution", xlabel="tokens", ylabel="trajectories")
    ax_t.legend(fontsize=8)
    _integer_ticks(ax_t, ax_h)
    return fig


def staleness_fractions(r: RunData) -> pd.Series:
    """Fraction of trained trajectories per staleness (trained-by version - oldest token version)."""
    gap = (r.ledger["trained_by_version"] - r.ledger["min_token_version"]).astype(int)
    return gap.value_counts(normalize=True).sort_index()


def plot_staleness(runs: list[RunData]) -> Figure:
    """Side-by-side bars centred on each whole staleness value, one colour per run."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(runs))
    top = 0
    for k, r in enumerate(runs):
        st = staleness_fractions(r)
        ax.bar(st.index.to_numpy() + (k - (len(runs) - 1) / 2) * width, st.values, width=width, label=r.label)
        top = max(top, int(st.index.max()) if len(st) else 0)
    ax.set_xticks(list(range(top + 1)))
    ax.set(
        title="staleness of trained trajectories (version gap of the oldest token)",
        xlabel="trained-by version - oldest token version",
        ylabel="fraction of trajectories",
        ylim=(0, 1.05),
    )
    ax.legend(fontsize=8)
    return fig


def plot_throughput(runs: list[RunData]) -> Figure:
    fig = Figure(figsize=(10, 4))
    ax_b, ax_t = fig.subplots(1, 2)
    ax_b.bar(range(len(runs)), [r.summary["effective_train_tokens_per_s"] for r in runs])
    ax_b.set_xticks(
        list(range(len(runs))), [f"{r.label}\n({_throughput_steps(r)} steps)" for r in runs], rotation=20, fontsize=8
    )
    ax_b.set(title="effective training throughput (after warm-up)", ylabel="trained tokens / s")
    for r in runs:
        m = r.metrics
        ax_t.plot(m["step"], _smooth(m["train_tokens_per_s"], len(m)), label=r.label)
    ax_t.set(title="per-step throughput (smoothed)", xlabel="step", ylabel="trained tokens / s")
    ax_t.legend(fontsize=8)
    _integer_ticks(ax_t)
    return fig


def _throughput_steps(r: RunData) -> int:
    """The steps a run's effective throughput rests on (older summaries: all but 2 warm-up steps)."""
    return int(r.summary.get("throughput_steps", max(1, r.summary["steps"] - 2)))


_PLOTTERS = {
    "learning_curve": plot_learning_curve,
    "accuracy": plot_accuracy,
    "answer_lengths": plot_answer_lengths,
    "staleness": plot_staleness,
    "throughput": plot_throughput,
}


# -- the report ----------------------------------------------------------------
def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_none_"

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
        return str(v)

    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(v) for v in row) + " |\n" for row in df.itertuples(index=False))


SHORT_THROUGHPUT = 5  # fewer measured steps than this: the throughput figure gets a caveat


def _throughput_caveats(runs: list[RunData]) -> list[str]:
    short = [(r.label, _throughput_steps(r)) for r in runs if _throughput_steps(r) < SHORT_THROUGHPUT]
    if not short:
        return []
    which = ", ".join(f"`{label}` on {k} step{'s' if k != 1 else ''}" for label, k in short)
    return [
        (
            f"**Caveat:** effective throughput rests on few steps after warm-up ({which}): a rough figure "
            "that one slow or fast step moves a lot; run more steps to compare throughput."
        ),
        "",
    ]


def _no_evals_reason(runs: list[RunData]) -> str:
    return (
        "None found under the runs' `evals/` folders. Checkpoints are evaluated by the `evaluate` "
        "deployment, which runs only while a Prefect stack is up (`areal-flow stack up`) and only for "
        "checkpoints the run marked (`evaluate_every`); or by hand: `areal-flow eval RUN/checkpoints/vN`."
    )


def render_markdown(title: str, table: pd.DataFrame, evals: pd.DataFrame, runs: list[RunData]) -> str:
    lines = [
        f"# {title}",
        "",
        (
            f"{len(runs)} run(s). `final_accuracy` is held-out accuracy after RL; "
            "`effective_train_tokens_per_s` counts generated tokens trained per second after warm-up."
        ),
        "",
        "## Runs",
        "",
        _md_table(table),
        "",
        *_throughput_caveats(runs),
        "## Checkpoint evaluations",
        "",
        _md_table(evals) if not evals.empty else _no_evals_reason(runs),
        "",
    ]
    missing = sorted({r.label for r in runs} - set(evals["run"])) if not evals.empty else []
    if missing:
        lines += [f"No checkpoint evaluations for: {', '.join(f'`{m}`' for m in missing)}.", ""]
    titles = {
        "learning_curve": "Learning curve",
        "accuracy": "Accuracy",
        "answer_lengths": "Answer lengths",
        "staleness": "Staleness distribution",
        "throughput": "Effective throughput",
    }
    for name in PLOTS:
        lines += [f"## {titles[name]}", "", f"![{name}]({name}.png)", ""]
    lines += ["## Run folders", ""] + [f"* `{r.label}`: {r.url}" for r in runs] + [""]
    return "\n".join(lines)


def write_report(run_urls: list[str], out_dir: str, title: str = "areal-flow report") -> dict:
    """Write report.md, report.csv and the PNG plots to ``out_dir``; return their URLs, the plots' bytes
    (``png``) and the tables."""
    if not run_urls:
        raise ReportError("no runs to report on")
    runs = [load_run(str(u)) for u in run_urls]
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):  # same folder names in different places: use indices
        for i, r in enumerate(runs):
            r.label = f"{i}:{r.label}"
    table, evals = run_table(runs), eval_table(runs)
    out_dir = str(out_dir)
    plots, pngs = {}, {}
    for name in PLOTS:
        url = join(out_dir, f"{name}.png")
        pngs[name] = _png(_PLOTTERS[name](runs))
        write_bytes_atomic(url, pngs[name])
        plots[name] = url
    csv_url, md_url = join(out_dir, "report.csv"), join(out_dir, "report.md")
    write_text_atomic(csv_url, table.to_csv(index=False))
    if not evals.empty:
        write_text_atomic(join(out_dir, "evals.csv"), evals.to_csv(index=False))
    markdown = render_markdown(title, table, evals, runs)
    write_text_atomic(md_url, markdown)  # last: report.md present means the report is whole
    return {
        "report": md_url,
        "csv": csv_url,
        "plots": plots,
        "png": pngs,
        "markdown": markdown,
        "table": table.to_dict(orient="records"),
        "evals": evals.to_dict(orient="records"),
    }
