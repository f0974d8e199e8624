"""The learning-against-wall-clock benchmark's own pieces (not its figures): when each saved model was
reached, which model a minute mark reads, the paired table against a hand computation, the settings
both sides get for seeds and saves, and which records stand for a run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pandas as pd
import pytest

from bench import learning_wallclock as lw
from bench import trl_peer_inputs as inputs
from bench import trl_peer_systems
from bench.trl_worker import grpo_args
from tests.bench_workloads import workload


def _workload(**kw) -> inputs.Workload:
    """The SmolLM2 workload's shape (8 x 8 answers, 40 new tokens, 40 steps)."""
    smollm2 = dict(name="smollm2", answers_per_prompt=8, max_new_tokens=40, dtype="bfloat16", chat=True, steps=40)
    return workload(**{**smollm2, **kw})


def test_trl_snapshot_times_leave_out_the_earlier_saves():
    out = {
        "train_start_s": 100.0,
        "steps": [{"step": i, "end_s": 100.0 + 10 * i + (5 if i > 2 else 0)} for i in range(1, 5)],
        # the save after step 2 took 5 s: it lies between step 2's and step 3's clock readings
        "snapshots": [{"step": 4, "dir": "/s/step-4", "save_s": 6.0}, {"step": 2, "dir": "/s/step-2", "save_s": 5.0}],
    }
    got = trl_peer_systems.trl_snapshots(out)
    assert got == [
        {"step": 2, "model": "/s/step-2", "train_s": 20.0},
        {"step": 4, "model": "/s/step-4", "train_s": 40.0},
    ]


def test_areal_snapshot_times_leave_out_the_checkpoint_writes(tmp_path):
    for v in (0, 2, 4, 10):  # v0: the model the run started from
        (tmp_path / "checkpoints" / f"v{v}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "v4.partial").mkdir()  # not a version
    steps = list(range(1, 11))
    ckpt = [7.0 if s in (2, 4, 10) else (float("nan") if s == 1 else 0.0) for s in steps]
    elapsed = []
    t = 0.0
    for c in ckpt:
        t += 10.0 + (0.0 if math.isnan(c) else c)
        elapsed.append(t)
    m = pd.DataFrame({"step": steps[::-1], "elapsed_s": elapsed[::-1], "checkpoint_time_s": ckpt[::-1]})
    got = trl_peer_systems.areal_snapshots(tmp_path, m)
    assert [(g["step"], g["train_s"]) for g in got] == [(2, 20.0), (4, 40.0), (10, 100.0)]
    assert got[0]["model"] == str(tmp_path / "checkpoints" / "v2")


def test_a_minute_mark_reads_the_last_model_saved_by_then():
    points = [
        {"step": 0, "train_s": 0.0, "accuracy": 0.2},
        {"step": 10, "train_s": 300.0, "accuracy": 0.3},
        {"step": 20, "train_s": 600.0, "accuracy": 0.5},
    ]
    assert lw.accuracy_at(points, 0.0) == 0.2
    assert lw.accuracy_at(points, 299.9) == 0.2
    assert lw.accuracy_at(points, 300.0) == 0.3
    assert lw.accuracy_at(points, 10_000.0) == 0.5


def _run(system: str, seed: int, points: list[tuple[float, float]]) -> dict:
    pts = [{"step": 10 * i, "train_s": s, "accuracy": a} for i, (s, a) in enumerate(points)]
    return {"system": system, "seed": seed, "points": pts, "train_s": pts[-1]["train_s"]}


def test_the_table_pairs_seeds_and_gives_student_t_intervals():
    runs = [
        _run(lw.TRL, 0, [(0, 0.2), (900, 0.3), (1800, 0.4)]),
        _run(lw.TRL, 1, [(0, 0.2), (960, 0.25), (1920, 0.35)]),
        _run(lw.ASYNC, 0, [(0, 0.2), (300, 0.3), (600, 0.45)]),
        _run(lw.ASYNC, 1, [(0, 0.2), (330, 0.35), (660, 0.4)]),
        _run(lw.SYNC, 0, [(0, 0.2), (400, 0.3), (800, 0.4)]),
    ]
    t = lw.table(runs)
    # marks every 5 min up to the slowest mean end (31 min), and the fastest's mean end (10.5 min) in
    # place of the mark less than a minute from it (10)
    assert t["marks_min"] == [5.0, 10.5, 15.0, 20.0, 25.0, 30.0]
    at10 = t["systems"][lw.ASYNC]["at"]["10.5"]  # seed 0 at 630 s: its 600 s model, 0.45; seed 1: its 330 s one, 0.35
    assert at10["mean"] == pytest.approx(0.40) and at10["n"] == 2
    half = 12.706204736 * statistics.stdev([0.45, 0.35]) / math.sqrt(2)  # t(0.975, 1) by table
    assert (at10["lo"], at10["hi"]) == pytest.approx((0.40 - half, 0.40 + half), rel=1e-6)
    d = t["differences"][f"{lw.ASYNC} - {lw.TRL}"]["10.5"]  # TRL had nothing saved by 10.5 min: 0.2 both seeds
    assert d["mean"] == pytest.approx(0.20) and d["n"] == 2
    d = t["differences"][f"{lw.ASYNC} - {lw.SYNC}"]["15.0"]  # one seed in common: no interval
    assert d["n"] == 1 and d["mean"] == pytest.approx(0.05) and math.isinf(d["hi"])
    assert t["systems"][lw.SYNC]["final"]["mean"] == 0.4
    assert t["systems"][lw.TRL]["minutes"]["mean"] == pytest.approx(31.0)


def test_seeds_and_saves_reach_both_sides(tmp_path):
    w = _workload(seed=3, snapshot_every=10)
    for mode in ("sync", "async"):
        cfg = inputs.areal_config(mode, w, None)
        assert cfg.seed == 3 and cfg.storage.checkpoint_every == 10 and cfg.storage.keep_last is None
    spec = inputs.trl_spec(w, tmp_path)
    assert spec["seed"] == 3 and grpo_args(spec)["seed"] == 3
    assert spec["save_every"] == 10 and spec["save_dir"] == str(tmp_path / "snapshots")
    plain = inputs.trl_spec(_workload(), tmp_path)
    assert "save_every" not in plain and plain["seed"] == inputs.SEED


def test_the_heldout_spec_is_what_the_evaluation_reads(tmp_path):
    from areal_core.eval.harness import run_heldout

    held = tmp_path / "e.jsonl"
    held.write_text(
        "".join(
            json.dumps({"id": f"e{i}", "task": "math", "prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n"
            for i in range(30)
        )
    )
    w = _workload(records=str(held), eval_records=str(held))
    bench, sampling = run_heldout(str(lw.heldout_spec(w, tmp_path / "spec", 20)))
    assert len(bench.load()) == 20 and bench.load()[0].id == "e0"
    assert sampling.temperature == 0.0 and sampling.max_new_tokens == 40


def test_a_record_stands_for_a_run_of_the_same_workload_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lw, "RECORDS", tmp_path)
    w = _workload(seed=1, snapshot_every=10)
    assert lw.recorded(lw.ASYNC, w) is None
    rec = {"system": lw.ASYNC, "seed": 1, "workload": {**lw.comparable(w), "model": "m"}, "points": []}
    (tmp_path / "async-s1.json").write_text(json.dumps(rec))
    assert lw.recorded(lw.ASYNC, w) == rec
    assert lw.recorded(lw.ASYNC, _workload(seed=1, snapshot_every=10, model="/elsewhere")) == rec  # paths differ
    assert lw.recorded(lw.ASYNC, _workload(seed=1, snapshot_every=5)) is None
    assert "snapshot_every: 10, now 5" in capsys.readouterr().out
    assert lw.recorded(lw.TRL, w) is None


def test_the_default_precision_run_is_the_async_run_in_areal_flows_own_rule():
    w = _workload(seed=2, snapshot_every=10)
    auto = lw.system_workload(lw.DEFAULT, w)
    assert inputs.areal_config("async", auto, None).model.dtype == "auto"
    assert inputs.areal_config("async", w, None).model.dtype == "bfloat16"  # the peers: the workload's dtype
    assert all(lw.system_workload(s, w) == w for s in trl_peer_systems.SYSTEMS)
    assert inputs.trl_spec(auto, Path("/tmp"))["dtype"] == "bfloat16"  # TRL's side never reads areal_dtype


def test_an_async_record_does_not_stand_for_the_default_precision_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lw, "RECORDS", tmp_path)
    w = _workload(seed=0, snapshot_every=10)
    older = {k: v for k, v in lw.comparable(w).items() if k != "areal_dtype"}  # written before the field existed
    rec = {"system": lw.ASYNC, "seed": 0, "workload": older, "points": []}
    (tmp_path / "async-s0.json").write_text(json.dumps(rec))
    assert lw.recorded(lw.ASYNC, w) == rec
    (tmp_path / "async-auto-s0.json").write_text(json.dumps({**rec, "system": lw.DEFAULT}))
    assert lw.recorded(lw.DEFAULT, lw.system_workload(lw.DEFAULT, w)) is None
    assert "areal_dtype: None, now 'auto'" in capsys.readouterr().out


def test_the_rendered_table_names_each_systems_commit_where_the_records_differ_in_it():
    from bench.render import learning_wallclock_runs

    def rec(system, seed, commit):
        r = _run(system, seed, [(0, 0.2), (300, 0.3)])
        return {**r, "commit": commit, "workload": {"steps": 10}, "effective_train_tokens_per_s": 50.0}

    same = {"a.json": rec(lw.ASYNC, 0, "abc1234"), "t.json": rec(lw.TRL, 0, "abc1234")}
    assert "commit" not in learning_wallclock_runs({"runs": same})
    other = {**same, "d.json": rec(lw.DEFAULT, 0, "def5678")}
    text = learning_wallclock_runs({"runs": other})
    row = next(line for line in text.splitlines() if line.startswith(f"| {lw.DEFAULT} |"))
    assert row.endswith("| def5678 |") and "| commit |" in text
