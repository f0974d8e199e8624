"""The benchmark plumbing (tables, atomic JSON, the summary of the records, batch builders); no timing checks."""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest

from bench import BENCHMARKS, DIAGNOSTICS, LEARNING
from bench.common import (
    fmt,
    format_table,
    machine_info,
    ratio,
    record_kind,
    save,
    spread,
    summarize,
    write_json_atomic,
)


def test_format_table_aligns_numbers_and_text():
    out = format_table(["name", "tok/s"], [("engine", 31300.0), ("HF generate", 24.25)], title="t")
    lines = out.splitlines()
    assert lines[0] == "t"
    assert lines[1].startswith("name")
    assert "31,300" in out and "24.2" in out
    widths = {len(ln) for ln in lines[1:]}
    assert len(widths) == 1  # numbers right-aligned to one width


def test_fmt_and_ratio_handle_missing_values():
    assert fmt(None) == "-" and fmt(True) == "yes" and fmt(3) == "3" and fmt(0.12345) == "0.123"
    assert ratio(2.0, 1.0) == 2.0 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def test_write_json_atomic_leaves_no_temp_file(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1, "b": (1, 2)})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1, "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "bad.json", {"x": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_saved_results_name_paths_in_the_checkout_relative_to_it(tmp_path):
    from bench.common import REPO_ROOT, save

    run = REPO_ROOT / "runs" / "bench" / "x" / "seed0"
    result = {
        "rows": [{"run_dir": str(run), "other": "/elsewhere/file", "both": f"{run}, {run}1"}],
        "plot": run / "a.png",
        "n": 3,
    }
    path = save("paths", True, result, 1.0, results_dir=tmp_path)
    saved = json.loads(path.read_text())
    rel = "runs/bench/x/seed0"
    assert saved["rows"] == [{"run_dir": rel, "other": "/elsewhere/file", "both": f"{rel}, {rel}1"}]
    assert saved["plot"] == "runs/bench/x/seed0/a.png" and saved["n"] == 3
    assert result["rows"][0]["run_dir"] == str(run)  # the caller's copy keeps its absolute paths


def test_the_summary_gathers_the_records_saved_on_this_machine(tmp_path):
    save("engine", True, {"summary": {"engine_over_hf_generate": 1.3}}, 1.0, results_dir=tmp_path)
    save("dynamic_batching", False, {"summary": {"dynamic_batching_gain": 1.2}}, 2.0, results_dir=tmp_path)
    s = summarize(tmp_path)
    (here,) = s["by_cpu_kind"].values()
    assert s["by_cpu_kind"] == {record_kind(machine_info()): here}
    assert here["engine"]["figures"] == {"engine_over_hf_generate": 1.3}
    assert here["dynamic_batching"]["figures"] == {"dynamic_batching_gain": 1.2}
    assert here["engine"]["command"] == "python -m bench engine --quick"
    assert here["engine"]["record"] == "engine.json"


def test_every_benchmark_module_has_run():
    import importlib

    for name in BENCHMARKS + LEARNING + DIAGNOSTICS:
        assert callable(importlib.import_module(f"bench.{name}").run)
    assert not set(BENCHMARKS) & set(LEARNING + DIAGNOSTICS)  # `all` leaves the learning runs and diagnostics out


def test_learning_tables_report_mean_and_spread_over_seeds():
    from bench.learning import mean_std, pm

    assert mean_std([0.1, 0.2, 0.3]) == pytest.approx((0.2, 0.1))
    assert pm([0.1, 0.2, 0.3]) == "+0.200 ± 0.100"
    assert mean_std([0.5]) == (0.5, 0.0)


def test_dynamic_batching_batches_and_memory_safe_count():
    from bench import dynamic_batching as db

    lens = db.heavy_tailed_lengths(2000, random.Random(0))
    assert min(lens) >= 4 and max(lens) <= db.MAX_NEW
    assert max(lens) > 4 * sorted(lens)[len(lens) // 2]  # a long tail
    n = db.memory_safe_fixed()
    per_mb = math.ceil(db.B / n)
    assert per_mb * (db.PROMPT_LEN[1] + db.MAX_NEW) <= db.BUDGET  # every fixed micro-batch fits the budget
    batch = db.make_batch(random.Random(1), vocab=40)
    assert len(batch) == db.B and len({t.group_id for t in batch}) == db.B // db.N_SAMPLES


def test_install_venv_runs_the_steps_and_names_the_one_that_failed(tmp_path):
    from bench.common import install_venv

    venv, log = tmp_path / "v", str(tmp_path / "install.log")
    ok = [["{py}", "-c", "open(r'%s', 'w').write('ran')" % (tmp_path / "marker")]]
    assert install_venv(venv, ok, log) is None and (tmp_path / "marker").read_text() == "ran"
    failing = [["{py}", "-c", "raise SystemExit(3)"]]
    assert install_venv(venv, failing, log) == f"`{venv}/bin/python -c raise SystemExit(3)` exited with 3; see {log}"
    assert install_venv(venv, failing, log, may_fail=lambda cmd: "SystemExit(3)" in cmd[-1]) is None


def test_objective_ablation_reuses_only_a_finished_run_of_the_same_config(tmp_path):
    from areal_core.experiment import load_config
    from bench.learning import CONFIG
    from bench.objective_ablation import _finished_run

    sets = ("trainer.eta=32", "trainer.objective=naive")
    run_dir = tmp_path / "eta32-naive-seed1"
    run_dir.mkdir()
    cfg = load_config(CONFIG, {"seed": 1, "trainer.eta": 32, "trainer.objective": "naive"}).model_dump(mode="json")
    (run_dir / "config.json").write_text(json.dumps(cfg))
    assert _finished_run(run_dir, 1, sets) is None  # no summary: it did not finish
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "accuracy_before": 0.4,
                "accuracy_after": 0.55,
                "wall_time_s": 200.0,
                "rl_time_s": 140.0,
                "effective_train_tokens_per_s": 7000.0,
                "max_staleness_observed": 32,
            }
        )
    )
    row = _finished_run(run_dir, 1, sets)
    assert row["gain"] == pytest.approx(0.15) and row["seed"] == 1 and row["max_staleness"] == 32
    assert _finished_run(run_dir, 2, sets) is None  # another seed: another config
    assert _finished_run(run_dir, 1, ("trainer.eta=8", "trainer.objective=naive")) is None


def test_core_split_reads_this_process_and_its_children():
    """The /proc sampler behind `python -m bench core_split`: a busy child process and this
    process's main thread are both counted, under their roles. (Both stay busy until the sampler has
    seen 0.3 s of CPU from each, or 20 s pass: on a loaded machine either gets less than its share.)"""
    import subprocess
    import sys

    from bench import core_split

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    main = ("trainer: main thread", os.getpid())
    try:
        time.sleep(0.2)
        a = core_split._sample()
        t0 = time.time()
        while time.time() - t0 < 20:  # the main thread busy too
            b = core_split._sample()
            if min(b.get(k, 0) - a.get(k, 0) for k in (("other processes", child.pid), main)) > 0.3:
                break
    finally:
        child.kill()
        child.wait()
    assert ("other processes", child.pid) in a and ("other processes", child.pid) in b
    assert b[("other processes", child.pid)] - a[("other processes", child.pid)] > 0.3
    assert b[main] - a[main] > 0.3


def test_a_benchmarks_work_dir_holds_its_latest_run_only(tmp_path, monkeypatch):
    import bench.common as common

    monkeypatch.setattr(common, "RUNS_DIR", tmp_path)
    first = common.work_dir("trl_peer")
    (first / "old.log").write_text("an earlier run")
    assert common.work_dir("trl_peer") == tmp_path / "trl_peer" and not (first / "old.log").exists()
    quick = common.work_dir("trl_peer", quick=True)
    assert quick == tmp_path / "trl_peer_quick" and quick.is_dir() and (tmp_path / "trl_peer").is_dir()
