"""The comparison report (areal_core.report.compare), the sweep grid and data preparation: no Prefect, no training."""

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from areal_core.data.prepare import prepare
from areal_core.data.records import RecordError, read_records
from areal_core.report.compare import (
    CSV_COLUMNS,
    PLOTS,
    ReportError,
    eval_dir_for_checkpoint,
    eval_dir_for_run,
    write_report,
)
from areal_core.run.sweep import plan_points, sweep_points
from tasks.events import should_evaluate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(folder, eta, objective, steps=6, acc_after=0.5, evals=None, seed=0):
    """A run folder as run_experiment writes it, with made-up numbers."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    metrics = pd.DataFrame(
        {
            "step": range(1, steps + 1),
            "reward": rng.normal(0, 1, steps),
            "accuracy": rng.uniform(0, 1, steps),
            "answer_len_mean": rng.uniform(10, 20, steps),
            "answer_len_p90": rng.uniform(20, 30, steps),
            "train_tokens_per_s": rng.uniform(500, 900, steps),
            "staleness_max": [min(eta, s) for s in range(steps)],
        }
    )
    metrics.to_parquet(f"{folder}/metrics.parquet")
    ledger = pd.DataFrame(
        {
            "trajectory_id": [f"t{i}" for i in range(steps * 4)],
            "step": np.repeat(range(1, steps + 1), 4),
            "trained_by_version": np.repeat(range(steps), 4),
            "n_tokens": rng.integers(5, 40, steps * 4),
        }
    )
    ledger["min_token_version"] = (ledger["trained_by_version"] - rng.integers(0, eta + 1, len(ledger))).clip(0)
    ledger.to_parquet(f"{folder}/ledger.parquet")
    summary = {
        "name": "fake",
        "accuracy_before": 0.4,
        "accuracy_after": acc_after,
        "steps": steps,
        "eta": eta,
        "objective": objective,
        "effective_train_tokens_per_s": 700.0 + eta,
        "wall_time_s": 100.0 + eta,
        "rl_time_s": 80.0,
        "max_staleness_observed": eta,
        "final_version": steps,
        "answer_length_after": {"p50": 15.0, "p90": 31.0, "max": 39},
        "ledger_check": {"ok": True},
    }
    with open(f"{folder}/summary.json", "w") as f:
        json.dump(summary, f)
    for version, pass1 in (evals or {}).items():
        d = eval_dir_for_run(folder, version)
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/summary.json", "w") as f:
            json.dump({"model": "x", "benchmarks": {"synthetic": {"pass@1": pass1, "n_problems": 20}}}, f)
    return str(folder)


def test_report_compares_runs(tmp_path):
    runs = [
        fake_run(tmp_path / f"eta{e}-{o}", e, o, acc_after=0.3 + 0.1 * i, evals={3: 0.2 + i / 10, 6: 0.5}, seed=i)
        for i, (e, o) in enumerate([(0, "decoupled"), (0, "naive"), (4, "decoupled"), (4, "naive")])
    ]
    out = write_report(runs, str(tmp_path / "report"), title="my sweep")
    assert out["report"] == str(tmp_path / "report/report.md")

    df = pd.read_csv(tmp_path / "report/report.csv")
    assert list(df.columns) == CSV_COLUMNS
    assert list(df["run"]) == ["eta0-decoupled", "eta0-naive", "eta4-decoupled", "eta4-naive"]
    assert list(df["eta"]) == [0, 0, 4, 4] and list(df["objective"]) == ["decoupled", "naive"] * 2
    assert df["final_accuracy"].round(3).tolist() == [0.3, 0.4, 0.5, 0.6]
    assert df["effective_train_tokens_per_s"].tolist() == [700.0, 700.0, 704.0, 704.0]
    assert df["wall_time_s"].tolist() == [100.0, 100.0, 104.0, 104.0] and (df["steps"] == 6).all()

    for name in PLOTS:
        data = (tmp_path / f"report/{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

    md = (tmp_path / "report/report.md").read_text()
    assert md.startswith("# my sweep")
    assert "| eta4-naive | 4 | naive | 0.600 |" in md
    for name in PLOTS:
        assert f"![{name}]({name}.png)" in md

    ev = pd.read_csv(tmp_path / "report/evals.csv")
    assert len(ev) == 8 and set(ev["version"]) == {3, 6}
    assert ev[(ev["run"] == "eta0-naive") & (ev["version"] == 3)]["accuracy"].item() == pytest.approx(0.3)
    # atomic writes leave no temp files behind
    assert not [p for p in os.listdir(tmp_path / "report") if p.startswith(".")]


def test_report_to_s3(tmp_path, monkeypatch):
    from areal_core.storage import read_bytes
    from areal_core.storage.fsutil import ensure_bucket
    from infra.s3 import MotoS3Server

    run = fake_run(tmp_path / "r", 2, "decoupled")
    with MotoS3Server() as s3:
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        ensure_bucket("s3://reports")
        out = write_report([run], "s3://reports/sweep1")
        assert out["csv"] == "s3://reports/sweep1/report.csv"
        assert read_bytes("s3://reports/sweep1/staleness.png").startswith(PNG_MAGIC)
        assert b"eta" in read_bytes("s3://reports/sweep1/report.csv")


def test_report_errors(tmp_path):
    with pytest.raises(ReportError, match="no runs"):
        write_report([], str(tmp_path / "out"))
    (tmp_path / "half").mkdir()
    with pytest.raises(ReportError, match=r"summary.json: not found"):
        write_report([str(tmp_path / "half")], str(tmp_path / "out"))
    assert not (tmp_path / "out" / "report.md").exists()


def test_eval_dir_layout():
    assert eval_dir_for_checkpoint("/r/run1/checkpoints/v12") == "/r/run1/evals/v12"
    assert eval_dir_for_checkpoint("s3://b/runs/x/v3/") == "s3://b/runs/x/evals/v3"
    with pytest.raises(ValueError, match="not a checkpoint version"):
        eval_dir_for_checkpoint("/r/run1/model")


def test_sweep_points_and_evaluate_marks():
    pts = sweep_points([0, 4], ["decoupled", "naive"], {"trainer.optim.lr": [1e-4]})
    assert [p[0] for p in pts] == [
        "eta0-decoupled-lr0.0001",
        "eta0-naive-lr0.0001",
        "eta4-decoupled-lr0.0001",
        "eta4-naive-lr0.0001",
    ]
    assert pts[3][1] == {"trainer.eta": 4, "trainer.objective": "naive", "trainer.optim.lr": 1e-4}
    with pytest.raises(ValueError, match="empty sweep"):
        sweep_points([], [], None)
    # the defaults: one config sweeps eta 0,4 x both objectives; several configs run as they are
    assert [p[0] for p in plan_points(None, None, None)] == [
        "eta0-decoupled",
        "eta0-naive",
        "eta4-decoupled",
        "eta4-naive",
    ]
    assert plan_points(None, None, None, n_configs=3) == [("", {})]
    assert plan_points(None, None, {"seed": [0, 1]}, n_configs=2) == [("seed0", {"seed": 0}), ("seed1", {"seed": 1})]
    assert plan_points([4], None, None, n_configs=2) == [("eta4", {"trainer.eta": 4})]
    assert [v for v in range(11) if should_evaluate(v, 10, 4)] == [4, 8, 10]
    assert [v for v in range(4) if should_evaluate(v, 3, None)] == [0, 1, 2, 3]
    assert not any(should_evaluate(v, 3, 0) for v in range(4))


def test_prepare_synthetic_and_bad_rows(tmp_path, monkeypatch):
    m = prepare("synthetic", str(tmp_path / "data"), synthetic={"n_train": 50, "n_eval": 10, "max_chain": 5})
    assert m["counts"] == {"train": 50, "eval": 10}
    train = read_records(m["files"]["train"])
    assert len(train) == 50 and train[0].task == "chain" and train[0].solution
    assert json.loads((tmp_path / "data/manifest.json").read_text())["files"] == m["files"]

    # a real dataset through areal_core.data.sources (the AIME 2024 file shipped in data/)
    m = prepare("aime24", str(tmp_path / "aime"), fmt="jsonl")
    assert m["counts"] == {"aime24": 30} and len(read_records(m["files"]["aime24"])) == 30

    # a source returning an invalid row: a clear error, and nothing written
    import areal_core.data.prepare as prep

    monkeypatch.setattr(
        prep,
        "read_named_source",
        lambda name, path=None: [
            {"id": "1", "task": "math", "prompt": "1+1"},
            {"id": "2", "task": "poetry", "prompt": "x"},
        ],
    )
    with pytest.raises(RecordError, match=r"gsm8k/gsm8k, record 1: field 'task'"):
        prepare("gsm8k", str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()

    monkeypatch.setattr(
        prep,
        "read_named_source",
        lambda name, path=None: [
            {"id": "1", "task": "math", "prompt": "a"},
            {"id": "1", "task": "math", "prompt": "b"},
        ],
    )
    with pytest.raises(RecordError, match="duplicate record id"):
        prepare("gsm8k", str(tmp_path / "dup"))
    assert not (tmp_path / "dup").exists()


def test_sweep_freezes_its_config(tmp_path):
    """Every run of a sweep loads the frozen copy: editing the original mid-sweep changes nothing."""
    from areal_core.experiment import load_config
    from areal_core.run.sweep import freeze_config

    src = tmp_path / "exp.yaml"
    src.write_text((Path(__file__).resolve().parents[1] / "data/campaign_tiny.yaml").read_text())
    frozen = freeze_config(str(src), str(tmp_path / "sweep/config.yaml"), {"trainer.max_steps": 7})
    src.write_text("name: broken\ntrainer: {etaa: 1}\n")
    cfg = load_config(frozen, {"trainer.eta": 0})
    assert (cfg.name, cfg.trainer.max_steps, cfg.trainer.eta, cfg.trainer.batch_size) == ("tiny", 7, 0, 8)


def test_report_plots_read_right(tmp_path):
    """Whole-number axes, a zoomed accuracy axis, a histogram binned on whole tokens, staleness bars
    centred on their values: the plots of a short sweep read right."""
    from areal_core.report.compare import (
        length_bins,
        load_run,
        plot_accuracy,
        plot_answer_lengths,
        plot_learning_curve,
        plot_staleness,
        plot_throughput,
    )

    runs = [
        load_run(fake_run(tmp_path / f"r{i}", eta=2, objective="decoupled", steps=3, acc_after=0.404 + i / 200, seed=i))
        for i in range(2)
    ]
    for plot in (plot_learning_curve, plot_answer_lengths, plot_throughput):
        fig = plot(runs)
        fig.canvas.draw()
        step_axes = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
        assert step_axes
        for ax in step_axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (plot.__name__, ticks)

    # held-out 0.400 -> 0.404 / 0.409: the axis is zoomed to the values, not drawn from 0
    ax_b = plot_accuracy(runs).axes[0]
    lo, hi = ax_b.get_ylim()
    assert 0.3 < lo < 0.4 and 0.409 < hi < 0.5, (lo, hi)

    # integer lengths: edges on half-integers, whole-token bins, every length inside
    lengths = pd.Series([5, 6, 6, 7, 40, 93])
    edges = length_bins(lengths)
    assert all((e + 0.5).is_integer() for e in edges) and len(set(np.diff(edges))) == 1
    assert len(edges) - 1 <= 30 and edges[0] < 5 and edges[-1] > 93
    assert np.histogram(lengths, edges)[0].sum() == len(lengths)

    # one run: bars centred exactly on the staleness values, ticks on whole numbers
    ax = plot_staleness(runs[:1]).axes[0]
    centres = sorted(p.get_x() + p.get_width() / 2 for p in ax.patches)
    assert all(abs(c - round(c)) < 1e-9 for c in centres) and list(ax.get_xticks()) == [0, 1, 2]


def test_report_says_when_a_figure_is_weak_or_missing(tmp_path):
    short = fake_run(tmp_path / "short", 1, "decoupled", steps=3)
    long = fake_run(tmp_path / "long", 1, "decoupled", steps=12)
    for folder, k in ((short, 1), (long, 10)):
        s = json.loads(Path(folder, "summary.json").read_text())
        Path(folder, "summary.json").write_text(json.dumps({**s, "throughput_steps": k}))
    md = write_report([short, long], str(tmp_path / "rep"))["markdown"]
    assert "**Caveat:** effective throughput rests on few steps after warm-up (`short` on 1 step)" in md
    assert "`long`" not in md.split("**Caveat:**")[1].split("\n")[0]
    # no evaluations anywhere: the report says why and how to get them
    assert "None found under the runs' `evals/` folders" in md and "areal-flow stack up" in md

    with_eval = fake_run(tmp_path / "ev", 1, "decoupled", steps=12, evals={3: 0.5})
    md = write_report([with_eval, long], str(tmp_path / "rep2"))["markdown"]
    assert "None found" not in md and "No checkpoint evaluations for: `long`." in md and "Caveat" not in md
