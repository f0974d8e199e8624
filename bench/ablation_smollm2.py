"""The objective ablation on SmolLM2-135M-Instruct: ``python -m bench objective_ablation --model smollm2``.

The tiny model's question (bench/objective_ablation.py) on a real model and its arithmetic task
(``configs/smollm2_quickstart.yaml``, equal steps, the trainer in float32): sync; eta 8 naive; eta 8
decoupled; eta 8 decoupled with each correction of SMOLLM2_CORRECTIONS (``trainer.off_policy``); eta 8
decoupled with the rollout servers in bfloat16 (``rollout.dtype``); seeds 0-1. A run takes 30 to 50
minutes on 2 AVX2-only cores (more for bf16 servers, emulated there), 13 to 18 on 2 cores with
AVX-512 BF16; the whole table 2.5 to 8 hours.
Held-out accuracy with spread, what each correction did, and the batch accuracy per step of every
setting in one plot (``bench/results/objective_ablation_smollm2.png``).

Run records. Each finished run leaves a record in ``bench/results/objective_ablation_smollm2_runs/``
(its figures, its per-step batch accuracy, its whole config, when and on which CPU it finished, the
benchmark's commit), so a table that takes hours survives the run folders (each holds a 1.6 GB
checkpoint): a record whose settings and config match what this would run (every key the record
has; a key added to the config since is not compared) stands for the run; one that does not is named
with the first difference and run again. A run folder under ``runs/bench/objective_ablation_smollm2/`` that finished is read first
and (re)writes its record; one the benchmark's stop interrupted resumes from its last checkpoint
(``--resume``). To run every setting again, remove the records. ``--quick`` (3 steps of each setting,
seed 0) neither reads nor writes records.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import REPO_ROOT, format_table, machine_info, write_json_atomic
from bench.learning import SYNC, accuracy_table, expected_config, run_row, runs_root, say, train

SMOLLM2_CONFIG = "configs/smollm2_quickstart.yaml"
SMOLLM2_CORRECTIONS = ("icepop", "tis")
# every setting trains in float32, so the last one differs from eta8-decoupled in the servers' dtype
# (and their request timeout): bfloat16 servers beside the float32 trainer (the engine-vs-trainer
# mismatch of large deployments; its logprob_gap_mean is in the runs' metrics)
SMOLLM2_FP32 = ("model.dtype=float32",)
SMOLLM2_SETTINGS = {
    name: sets + SMOLLM2_FP32
    for name, sets in {
        "sync": SYNC,
        "eta8-naive": ("trainer.eta=8", "trainer.objective=naive"),
        "eta8-decoupled": ("trainer.eta=8", "trainer.objective=decoupled"),
        **{
            f"eta8-decoupled-{k}": ("trainer.eta=8", "trainer.objective=decoupled", f"trainer.off_policy.kind={k}")
            for k in SMOLLM2_CORRECTIONS
        },
        # emulated bfloat16 (a CPU without bf16 units) answers the 400 held-out problems in more than
        # the default request timeout of 600 s
        "eta8-decoupled-bf16-servers": (
            "trainer.eta=8",
            "trainer.objective=decoupled",
            "rollout.dtype=bfloat16",
            "rollout.request_timeout_s=3600",
        ),
    }.items()
}
SMOLLM2_CORE = ("sync", "eta8-naive", "eta8-decoupled")
# a SmolLM2 checkpoint with its resume state is 1.6 GB: a run keeps its newest one only (what --resume
# reads; the benchmark reads summary.json and the metrics), not the config's two
SMOLLM2_DISK = ("storage.keep_last=1",)
RECORDS = "objective_ablation_smollm2_runs"


def records_dir() -> Path:
    from bench import common  # read at call time: tests point RESULTS_DIR elsewhere

    return common.RESULTS_DIR / RECORDS


def run_smollm2(quick: bool, train_missing: bool = True) -> dict:
    """The ablation (see the module docstring); --quick: seed 0, 3 steps of each setting.
    ``train_missing=False``: the table of the runs finished or recorded so far, training nothing
    (``python -c "from bench.ablation_smollm2 import run_smollm2; run_smollm2(False, False)"``)."""
    from bench.common import RESULTS_DIR
    from bench.smollm2_seeds import QUICK_SETS

    seeds = (0,) if quick else (0, 1)
    root = runs_root("objective_ablation_smollm2" + ("_quick" if quick else ""))
    rows = []
    # the central comparison (sync, naive, decoupled) on every seed first, then the corrections and
    # the bf16 servers: a stopped benchmark leaves whole comparisons, the most telling first
    core = [n for n in SMOLLM2_SETTINGS if n in SMOLLM2_CORE]
    rest = [n for n in SMOLLM2_SETTINGS if n not in SMOLLM2_CORE]
    for names in (core, rest):
        for seed, name in itertools.product(seeds, names):
            label, sets = f"{name}-seed{seed}", SMOLLM2_SETTINGS[name]
            if quick:
                train(label, seed, sets + QUICK_SETS + SMOLLM2_DISK, root, config=SMOLLM2_CONFIG)
                rows.append(_record(name, seed, sets + QUICK_SETS, root / label))
                continue
            row = None
            if (root / label / "summary.json").is_file():
                row = _record(name, seed, sets, root / label)
                _keep(row)
            if row is None:
                row = _recorded(name, seed, sets)
            if row is None and train_missing:
                train(label, seed, sets + SMOLLM2_DISK, root, config=SMOLLM2_CONFIG, resume_stopped=True)
                row = _record(name, seed, sets, root / label)
                _keep(row)
            if row is not None:
                rows.append(row)
    rows.sort(key=lambda r: (list(SMOLLM2_SETTINGS).index(r["setting"]), r["seed"]))
    names = [n for n in SMOLLM2_SETTINGS if any(r["setting"] == n for r in rows)]
    title = "SmolLM2-135M: objective ablation (held-out accuracy after RL)"
    stats = accuracy_table(rows, names, seeds, title if train_missing else title + ", finished runs so far")
    _offpolicy_table(rows, names)
    out = (RESULTS_DIR / "quick" if quick else RESULTS_DIR) / "objective_ablation_smollm2.png"
    if not train_missing:
        out = out.with_name("objective_ablation_smollm2.so_far.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    if rows:
        _plot_curves(rows, out)
    summary = {f"{n}_after_mean": m for n, (m, _) in stats.items()} | {
        f"{n}_after_std": s for n, (_, s) in stats.items()
    }
    for key, a, b in (
        ("naive_minus_decoupled", "eta8-naive", "eta8-decoupled"),
        ("decoupled_minus_sync", "eta8-decoupled", "sync"),
    ):
        if a in stats and b in stats:
            summary[key] = stats[a][0] - stats[b][0]
            print(f"{a} - {b}: {summary[key]:+.3f}")
    rows = [{k: v for k, v in r.items() if k != "config"} for r in rows]  # the configs are in the records
    return {"model": "smollm2-135m", "seeds": list(seeds), "rows": rows, "summary": summary, "plot": str(out)}


def _record(name: str, seed: int, sets: tuple[str, ...], run_dir: Path) -> dict:
    """A finished run's record: its row (bench.learning.run_row), what the corrections did, its batch
    accuracy per step, its config, and when and where it finished."""
    import pandas as pd

    from areal_core.device import cpu_bf16_units

    label = f"{name}-seed{seed}"
    m = pd.read_parquet(run_dir / "metrics.parquet")
    finished = (run_dir / "summary.json").stat().st_mtime
    row = run_row(label, seed, sets, run_dir)
    try:  # where the run folder lives in this checkout (records name no machine's folder)
        row["run_dir"] = str(run_dir.resolve().relative_to(REPO_ROOT.resolve()))
    except ValueError:
        pass
    return {
        "setting": name,
        **row,
        **_offpolicy_stats(m),
        "curve": {"step": m["step"].tolist(), "accuracy": m["accuracy"].tolist()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(finished)),
        "cpu": machine_info()["cpu"],
        "cpu_bf16_units": cpu_bf16_units(),  # AMX / AVX-512 BF16, or None: two CPUs of one name can differ
        "benchmark_commit": _commit(),  # of the code writing the record: a run folder does not name its code
        "config": json.loads((run_dir / "config.json").read_text()),
    }


def _commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return out.stdout.strip() or None


def _keep(row: dict) -> None:
    """Write the run's record unless the same run's record (same finish time) is there already."""
    path = records_dir() / f"{row['label']}.json"
    if path.is_file() and json.loads(path.read_text()).get("finished_at") == row["finished_at"]:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, row)


def _recorded(name: str, seed: int, sets: tuple[str, ...]) -> dict | None:
    """The record of this run if its settings and config are those this would run, else None (said why)."""
    path = records_dir() / f"{name}-seed{seed}.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    why = (
        f"settings {rec.get('sets')} != {list(sets)}"
        if rec.get("sets") != list(sets)
        else config_difference(rec.get("config") or {}, expected_config(SMOLLM2_CONFIG, seed, sets + SMOLLM2_DISK))
    )
    if why:
        say(f"{path.name}: not reused ({why}); running it again")
        return None
    say(f"{rec['label']}: the record of {rec['finished_at']} ({rec['cpu']}, recorded at {rec['benchmark_commit']})")
    return rec


def config_difference(recorded: dict, want: dict, prefix: str = "") -> str | None:
    """The first key of ``recorded`` whose value differs from ``want``'s, as 'key: recorded != want';
    keys ``recorded`` lacks are not compared (a field added since, at its default)."""
    for key, value in recorded.items():
        here = f"{prefix}{key}"
        if key not in want:
            return f"{here}: no longer a config key"
        if isinstance(value, dict) and isinstance(want[key], dict):
            if diff := config_difference(value, want[key], here + "."):
                return diff
        elif value != want[key]:
            return f"{here}: {value!r} != {want[key]!r}"
    return None


def _offpolicy_stats(m) -> dict:
    """What the off-policy corrections did over a run (means over its steps of its metrics ``m``), and
    the engine-vs-trainer logprob gap at the behaviour version over all the tokens it was measured on;
    None for what the run's objective does not record (the naive one has no gap)."""

    def over_steps(col: str, how: str = "mean") -> float | None:
        return float(getattr(m[col], how)()) if col in m else None

    tokens = over_steps("logprob_gap_tokens_sum", "sum") or 0.0
    return {
        "offpolicy_masked_fraction": over_steps("offpolicy_masked_fraction"),
        "offpolicy_truncated_fraction": over_steps("offpolicy_truncated_fraction"),
        "offpolicy_ess": over_steps("offpolicy_ess"),
        "offpolicy_weight_max": over_steps("offpolicy_weight_max", "max"),
        "logprob_gap_mean": over_steps("logprob_gap_sum", "sum") / tokens if tokens else None,
        "logprob_gap_tokens": int(tokens),
    }


def _offpolicy_table(rows: list[dict], names) -> None:
    def mean(mine, key, digits):  # "-" where no run of the setting records it
        xs = [r[key] for r in mine if r[key] is not None]
        return f"{statistics.fmean(xs):.{digits}}" if xs else "-"

    table = []
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        weights = [r["offpolicy_weight_max"] for r in mine if r["offpolicy_weight_max"] is not None]
        table.append(
            (
                name,
                mean(mine, "offpolicy_masked_fraction", "4f"),
                mean(mine, "offpolicy_truncated_fraction", "4f"),
                mean(mine, "offpolicy_ess", "3f"),
                f"{max(weights):.2f}" if weights else "-",
                mean(mine, "logprob_gap_mean", "2e"),
                mean(mine, "tokens_per_s", "0f"),
            )
        )
    print(
        format_table(
            ["setting", "masked", "truncated", "ESS", "max weight", "logprob gap", "train tok/s"],
            table,
            title="what the corrections did (means over steps and seeds) and the engine-vs-trainer gap",
        )
    )


def _plot_curves(rows: list[dict], path) -> None:
    """Batch accuracy per step, mean over seeds, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["setting"] for r in rows):
        curves = [pd.Series(r["curve"]["accuracy"], index=r["curve"]["step"]) for r in rows if r["setting"] == name]
        runs = f"{len(curves)} run" + ("s" if len(curves) > 1 else "")
        ax.plot(pd.concat(curves, axis=1).mean(axis=1).rolling(3, min_periods=1).mean(), label=f"{name} ({runs})")
    ax.set_xlabel("step")
    ax.set_ylabel("batch accuracy (mean over seeds, 3-step average)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
