"""What the Prefect UI shows of a run: plots as PNG images inside markdown (``data:`` URIs, which the
UI renders inline), tables with numbers rounded for people. Full precision stays in the run folder
(``metrics.parquet``, ``summary.json``, an evaluation's ``results.parquet``).

* :func:`training_markdown`: a training run's learning curves (batch and held-out accuracy,
  reward, staleness, tokens/s, answer length), redrawn at each checkpoint;
* :func:`evaluation_markdown`: an evaluation's pass@k per benchmark, and pass@1 over the run's
  evaluated checkpoints;
* :func:`report_for_ui`: a report's markdown with its PNG plots inside it, its table narrowed.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re

import pandas as pd

from areal_core.report.compare import _integer_ticks, _smooth
from areal_core.storage.fsutil import filesystem, join

UI_DPI = 80  # the UI shows the plots at about 1000 px wide: enough, and small artifacts


def for_people(value, digits: int = 4):
    """A float rounded to ``digits`` significant figures (0.09000000000000002 -> 0.09); other values as they are."""
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return value
    places = digits - 1 - math.floor(math.log10(abs(value)))
    return round(value, places) if places > 0 else int(round(value, places))  # 1923.04 -> 1923


def rounded_rows(rows: list[dict], digits: int = 4) -> list[dict]:
    return [{k: for_people(v, digits) for k, v in row.items()} for row in rows]


def png_bytes(fig, dpi: int = UI_DPI) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def md_image(alt: str, png: bytes) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def md_table(header: tuple[str, ...], rows: list[tuple]) -> str:
    """A markdown table with a header row; numbers rounded for people."""

    def cell(v) -> str:
        v = for_people(v)
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000 else str(v)

    def numeric(i: int) -> bool:
        return all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows)

    align = ["---:" if rows and numeric(i) else ":---" for i in range(len(header))]  # numbers right, text left
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


# -- a training run ------------------------------------------------------------------------------
def run_evaluations(run_dir: str) -> pd.DataFrame:
    """pass@1 of the run's evaluated checkpoints (``<run>/evals/v<N>/summary.json``): version, bench, pass@1."""
    from areal_core.report.compare import _read_evals

    return _read_evals(run_dir).rename(columns={"accuracy": "pass@1"})


def training_figure(metrics: pd.DataFrame, heldout: dict[int, float], evals: pd.DataFrame, total_steps: int):
    """Six panels over the steps: batch accuracy, held-out accuracy (before RL, after RL, checkpoint
    evaluations), reward, staleness, trained tokens/s, answer length."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 10))  # the UI shows it about 700 px wide: two panels a row stay legible
    axes = fig.subplots(3, 2)
    (ax_acc, ax_held), (ax_r, ax_st), (ax_tp, ax_len) = axes
    m, n = metrics, max(1, len(metrics))
    ax_acc.plot(m["step"], m["accuracy"], alpha=0.3, color="tab:blue")
    ax_acc.plot(m["step"], _smooth(m["accuracy"], n), color="tab:blue")
    ax_acc.set(title="batch accuracy (on the prompts drawn)", ylabel="accuracy")
    if heldout:
        xs = sorted(heldout)
        ax_held.plot(xs, [heldout[x] for x in xs], "o", ms=8, color="tab:green", label="held-out (before / after RL)")
    for bench, group in evals.groupby("bench") if len(evals) else []:
        g = group.sort_values("version")
        ax_held.plot(g["version"], g["pass@1"], "s--", label=f"checkpoint evaluation: {bench}")
    ax_held.set(title="held-out accuracy", ylabel="accuracy")
    if heldout or len(evals):
        ax_held.legend(fontsize=7)
    ax_r.plot(m["step"], m["reward"], alpha=0.3, color="tab:orange")
    ax_r.plot(m["step"], _smooth(m["reward"], n), color="tab:orange")
    ax_r.set(title="mean reward per batch", ylabel="reward")
    ax_st.plot(m["step"], m["staleness_max"], drawstyle="steps-mid", label="max")
    ax_st.plot(m["step"], m["staleness_mean"], label="mean")
    ax_st.set(title="staleness of trained answers (versions)", ylabel="versions")
    ax_st.legend(fontsize=7)
    ax_tp.plot(m["step"], _smooth(m["train_tokens_per_s"], n), color="tab:purple")
    ax_tp.set(title="trained tokens / s (smoothed)", ylabel="tokens / s")
    ax_len.plot(m["step"], _smooth(m["answer_len_mean"], n), label="mean")
    ax_len.plot(m["step"], _smooth(m["answer_len_p90"], n), ls="--", label="p90")
    ax_len.set(title="trained answer length (smoothed)", ylabel="tokens")
    ax_len.legend(fontsize=7)
    pad = 0.03 * max(total_steps, 1) + 0.5  # the points at step 0 and at the last step drawn whole
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.set_xlim(-pad, max(total_steps, 1) + pad)
        ax.grid(alpha=0.3)
    _integer_ticks(*axes.flat)
    fig.tight_layout()
    return fig


def training_markdown(
    name: str, run_dir: str, rows: list[dict], heldout: dict[int, float], evals: pd.DataFrame, total_steps: int
) -> str:
    """The learning-curves artifact of a training run, as of its latest step."""
    metrics = pd.DataFrame(rows)
    done = int(metrics["step"].max()) if len(metrics) else 0
    lines = [f"### {name}: learning curves, step {done} of {total_steps}", ""]
    if len(metrics):
        lines += [
            md_image(f"learning curves of {name}", png_bytes(training_figure(metrics, heldout, evals, total_steps))),
            "",
        ]
    last = metrics.iloc[-1] if len(metrics) else None
    rows_out = [
        (
            "held-out accuracy",
            " -> ".join(f"{for_people(heldout[k])} (step {k})" for k in sorted(heldout)) or "not measured yet",
        )
    ]
    if last is not None:
        rows_out += [
            ("batch accuracy, last step", last["accuracy"]),
            ("reward, last step", last["reward"]),
            ("max staleness, last step", int(last["staleness_max"])),
            ("trained tokens / s, last step", float(last["train_tokens_per_s"])),
        ]
    lines += [
        md_table(("measure", "value"), rows_out),
        "",
        f"Redrawn at each checkpoint. Every value: `{join(run_dir, 'metrics.parquet')}`.",
    ]
    return "\n".join(lines)


# -- an evaluation -------------------------------------------------------------------------------
def pass_curve(results: pd.DataFrame, k: int) -> list[float]:
    """Unbiased pass@j for j = 1..k from per-answer rows (problem_id, correct)."""
    from areal_core.eval.passk import pass_at_k

    per = results.groupby("problem_id")["correct"].agg(["size", "sum"])
    return [
        float(sum(pass_at_k(int(n), int(c), j) for n, c in zip(per["size"], per["sum"])) / max(1, len(per)))
        for j in range(1, k + 1)
    ]


def _read_results(eval_dir: str, bench: str) -> pd.DataFrame | None:
    fs, path = filesystem(join(eval_dir, bench, "results.parquet"))
    if not fs.exists(path):
        return None
    return pd.read_parquet(io.BytesIO(fs.cat_file(path)))


def evaluation_figure(summary: dict, eval_dir: str, history: pd.DataFrame | None):
    """Left: pass@j for j = 1..k per benchmark (bars when k = 1); right: pass@1 by checkpoint version."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax_k, ax_v = fig.subplots(1, 2)
    benches = summary["benchmarks"]
    k = max((b["samples"] for b in benches.values()), default=1)
    for i, (name, b) in enumerate(benches.items()):
        results = _read_results(eval_dir, name)
        curve = pass_curve(results, b["samples"]) if results is not None else [b["pass@1"]]
        if k == 1:
            ax_k.bar(i, curve[0])
            ax_k.text(i, curve[0], f"{for_people(curve[0])}", ha="center", va="bottom", fontsize=8)
        else:
            ax_k.plot(range(1, len(curve) + 1), curve, "o-", label=b.get("label", name))
    if k == 1:
        ax_k.set_xticks(range(len(benches)), [b.get("label", n) for n, b in benches.items()], fontsize=8)
        ax_k.set(title=f"pass@1 ({'1 answer' if k == 1 else k} per problem)", ylabel="pass@1", ylim=(0, 1.05))
    else:
        ax_k.set(title=f"pass@k ({k} answers per problem)", xlabel="k", ylabel="pass@k", ylim=(0, 1.05))
        ax_k.legend(fontsize=7)
    if history is not None and len(history):
        for bench, group in history.groupby("bench"):
            g = group.sort_values("version")
            ax_v.plot(g["version"], g["pass@1"], "o-", label=bench)
        ax_v.legend(fontsize=7)
    else:
        ax_v.text(
            0.5, 0.5, "no other evaluated checkpoint of this run", ha="center", va="center", transform=ax_v.transAxes
        )
    top = int(history["version"].max()) if history is not None and len(history) else 1
    ax_v.set(
        title="pass@1 by checkpoint version (this run)",
        xlabel="checkpoint version",
        ylabel="pass@1",
        ylim=(0, 1.05),
        xlim=(-0.5, top + 0.5),
    )
    _integer_ticks(*((ax_k, ax_v) if k > 1 else (ax_v,)))
    fig.tight_layout()
    return fig


def evaluation_rows(summary: dict) -> list[dict]:
    """One narrow row per benchmark, rounded: bench, problems, k, pass@1, pass@k, maj@k, mean length, truncated."""
    out = []
    for name, b in summary["benchmarks"].items():
        k = b["samples"]
        row = {"bench": name, "problems": b["n_problems"], "k": k, "pass@1": b["pass@1"]}
        if k > 1:
            row["pass@k"] = b.get(f"pass@{k}")
            if f"maj@{k}" in b:
                row["maj@k"] = b[f"maj@{k}"]
        row.update({"mean length": b["mean_length"], "truncated": b["truncated_share"]})
        out.append(row)
    return rounded_rows(out)


def evaluation_markdown(title: str, summary: dict, eval_dir: str, history: pd.DataFrame | None) -> str:
    rows = evaluation_rows(summary)
    header = tuple(dict.fromkeys(k for r in rows for k in r))
    return "\n".join(
        [
            f"### {title}",
            "",
            f"`{summary['model']}`",
            "",
            md_table(header, [tuple(r.get(h, "") for h in header) for r in rows]),
            "",
            md_image(f"pass@k of {title}", png_bytes(evaluation_figure(summary, eval_dir, history))),
            "",
            f"Every answer: `{join(eval_dir, '<bench>', 'results.parquet')}`.",
        ]
    )


# -- a report ------------------------------------------------------------------------------------
def runs_rows(table: list[dict]) -> tuple[tuple[str, ...], list[tuple]]:
    """The report's runs, narrow enough for the UI's artifact column (every column: report.csv)."""
    header = ("run", "eta", "objective", "accuracy", "gain", "tokens/s", "wall s", "max staleness", "ledger")
    rows = [
        (
            r["run"],
            r["eta"],
            r["objective"],
            f"{r['accuracy_before']:.3f} -> {r['final_accuracy']:.3f}",
            f"{r['accuracy_gain']:+.3f}",
            for_people(float(r["effective_train_tokens_per_s"])),
            for_people(float(r["wall_time_s"])),
            r["max_staleness_observed"],
            "ok" if r["ledger_ok"] else "NOT ok",
        )
        for r in table
    ]
    return header, rows


def report_for_ui(markdown: str, table: list[dict], plots: dict[str, bytes]) -> str:
    """The report as the UI shows it: its runs table narrowed (:func:`runs_rows`), and each
    ``![name](name.png)`` replaced by the image itself."""

    def image(m: re.Match) -> str:
        name = m.group(2)
        return md_image(m.group(1), plots[name]) if name in plots else m.group(0)

    narrow = md_table(*runs_rows(table)) + "\n\nEvery column: `report.csv`.\n"
    markdown = re.sub(r"(## Runs\n\n)(\|.*\n)+", lambda m: m.group(1) + narrow, markdown, count=1)
    return re.sub(r"!\[([^\]]*)\]\(([a-z_]+)\.png\)", image, markdown)


def heldout_from_checkpoint(store, version: int) -> float | None:
    """Held-out accuracy before RL, as the run state in checkpoint ``version`` recorded it (None: not yet)."""
    from areal_core.storage.run_state import STATE

    try:
        state = json.loads(store.read_file(version, STATE))
    except FileNotFoundError:  # no such version (VersionNotFoundError), or one without run state
        return None
    before = state.get("before")
    return float(before["accuracy"]) if before else None
