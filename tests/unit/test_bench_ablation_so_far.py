"""The SmolLM2 objective ablation's table of the runs finished so far (it trains nothing), and the
records that stand for finished runs once their folders are gone."""

import json

import pandas as pd
import pytest

import bench.ablation_smollm2 as ab
import bench.common


def _fake_run(folder, after: float, gap_sum: float, gap_tokens: int, with_gap: bool = True) -> None:
    folder.mkdir(parents=True)
    summary = {
        "accuracy_before": 0.2,
        "accuracy_after": after,
        "wall_time_s": 10.0,
        "rl_time_s": 8.0,
        "effective_train_tokens_per_s": 50.0,
        "max_staleness_observed": 8,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps({"model": {"warm_start": None}}))
    steps = [1, 2]
    metrics = pd.DataFrame(
        {
            "step": steps,
            "accuracy": [0.3, 0.4],
            "offpolicy_masked_fraction": [0.1, 0.3],
            "offpolicy_truncated_fraction": [0.0, 0.0],
            "offpolicy_ess": [0.9, 0.7],
            "offpolicy_weight_max": [2.0, 5.0],
            "logprob_gap_sum": [gap_sum, 0.0],
            "logprob_gap_tokens_sum": [gap_tokens, 0],
        }
    )
    if not with_gap:  # the naive objective records no engine-vs-trainer gap
        metrics = metrics.drop(columns=["logprob_gap_sum", "logprob_gap_tokens_sum"])
    metrics.to_parquet(folder / "metrics.parquet")


def test_finished_runs_make_the_table_and_nothing_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "runs_root", lambda name: tmp_path / name)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(ab, "train", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    root = tmp_path / "objective_ablation_smollm2"
    _fake_run(root / "sync-seed0", 0.5, 0.0, 0)
    _fake_run(root / "eta8-naive-seed0", 0.3, 0.0, 0)
    _fake_run(root / "eta8-naive-seed1", 0.4, 0.0, 0, with_gap=False)
    _fake_run(root / "eta8-decoupled-seed0", 0.45, 0.5, 100)  # the gap: 0.5 nats over 100 tokens
    (root / "eta8-decoupled-seed1").mkdir()  # started, not finished: left out
    out = ab.run_smollm2(False, train_missing=False)
    assert [(r["setting"], r["seed"]) for r in out["rows"]] == [
        ("sync", 0),
        ("eta8-naive", 0),
        ("eta8-naive", 1),
        ("eta8-decoupled", 0),
    ]
    s = out["summary"]
    assert abs(s["eta8-naive_after_mean"] - 0.35) < 1e-12
    assert abs(s["naive_minus_decoupled"] - (0.35 - 0.45)) < 1e-12
    assert abs(s["decoupled_minus_sync"] - (0.45 - 0.5)) < 1e-12
    dec = out["rows"][3]
    assert dec["logprob_gap_mean"] == 0.005 and dec["logprob_gap_tokens"] == 100
    assert dec["offpolicy_masked_fraction"] == 0.2 and dec["offpolicy_weight_max"] == 5.0
    assert out["rows"][0]["logprob_gap_mean"] is None and out["rows"][2]["logprob_gap_mean"] is None
    assert (tmp_path / "results" / "objective_ablation_smollm2.so_far.png").is_file()
    printed = capsys.readouterr().out
    assert "finished runs so far" in printed
    lines = {}  # the accuracy table's lines (the first of the two tables)
    for line in printed.splitlines():
        if line.startswith(("sync ", "eta8-naive ")):
            lines.setdefault(line.split()[0], line)
    assert lines["sync"].split()[1:4] == ["0.500", "-", "0.500"] and "(1 run)" in lines["sync"]
    assert lines["eta8-naive"].split()[1:6] == ["0.300", "0.400", "0.350", "±", "0.071"]


def test_a_stopped_run_resumes_and_a_fresh_one_starts_clean(tmp_path, monkeypatch):
    import subprocess

    import bench.learning as learning

    calls = []

    def fake_run(cmd, cwd, stdout, stderr):
        calls.append(cmd)
        run_dir = tmp_path / "runs" / cmd[cmd.index("--run-dir") + 1].rsplit("/", 1)[-1]
        if run_dir.exists():  # resumed: the run finishes
            _finish(run_dir)
        else:
            _fake_run(run_dir, 0.4, 0.0, 0)
        return subprocess.CompletedProcess(cmd, 0)

    def _finish(run_dir):
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "accuracy_before": 0.2,
                    "accuracy_after": 0.6,
                    "wall_time_s": 1.0,
                    "rl_time_s": 1.0,
                    "effective_train_tokens_per_s": 1.0,
                    "max_staleness_observed": 0,
                }
            )
        )

    def publish(run_dir, version):  # a complete checkpoint, as the run's store publishes it
        from areal_core.storage import CheckpointStore

        folder = tmp_path / f"weights-{run_dir.name}-v{version}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w")
        CheckpointStore(str(run_dir / "checkpoints")).publish_folder(version, str(folder))

    monkeypatch.setattr(learning.subprocess, "run", fake_run)
    root = tmp_path / "runs"
    stopped = root / "stopped"
    stopped.mkdir(parents=True)
    (stopped / "config.json").write_text(json.dumps({"model": {"warm_start": None}}))
    publish(stopped, 0)
    publish(stopped, 10)
    assert learning._stopped_after_a_checkpoint(stopped)
    row = learning.train("stopped", 0, ("trainer.eta=8",), root, resume_stopped=True)
    assert calls[-1][-1] == "--resume" and row["after"] == 0.6  # continued, its folder kept
    assert (stopped / "checkpoints" / "v10").is_dir()

    only_v0 = root / "only_v0"
    only_v0.mkdir()
    (only_v0 / "config.json").write_text(json.dumps({"model": {"warm_start": None}}))
    publish(only_v0, 0)
    (only_v0 / "checkpoints" / "v10").mkdir()  # a checkpoint whose writing was cut short: not complete
    assert not learning._stopped_after_a_checkpoint(only_v0)
    row = learning.train("only_v0", 0, (), root, resume_stopped=True)
    assert "--resume" not in calls[-1] and row["after"] == 0.4  # started afresh: the old folder removed
    assert not (only_v0 / "checkpoints").exists()
    (stopped / "summary.json").unlink()
    row = learning.train("stopped", 0, (), root)  # without resume_stopped: always afresh
    assert "--resume" not in calls[-1] and row["after"] == 0.4


def test_records_stand_for_removed_runs_and_only_for_the_same_config(tmp_path, monkeypatch, capsys):
    import shutil

    from areal_core.experiment import load_config, parse_overrides

    monkeypatch.setattr(ab, "runs_root", lambda name: tmp_path / name)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    trained = []
    monkeypatch.setattr(ab, "train", lambda label, *a, **k: trained.append(label))
    root = tmp_path / "objective_ablation_smollm2"
    _fake_run(root / "sync-seed0", 0.5, 0.0, 0)
    _fake_run(root / "eta8-decoupled-seed1", 0.45, 0.5, 100)
    first = ab.run_smollm2(False, train_missing=False)
    records = tmp_path / "results" / ab.RECORDS
    assert sorted(p.name for p in records.iterdir()) == ["eta8-decoupled-seed1.json", "sync-seed0.json"]
    rec = json.loads((records / "sync-seed0.json").read_text())
    assert rec["curve"] == {"step": [1, 2], "accuracy": [0.3, 0.4]} and rec["after"] == 0.5
    assert rec["cpu"] and rec["finished_at"]

    # the records hold the config the fake runs wrote; give them the ones the benchmark would run
    for label, name, seed in (("sync-seed0", "sync", 0), ("eta8-decoupled-seed1", "eta8-decoupled", 1)):
        sets = ab.SMOLLM2_SETTINGS[name] + ab.SMOLLM2_DISK
        want = load_config(ab.SMOLLM2_CONFIG, {"seed": seed, **parse_overrides(list(sets))}).model_dump(mode="json")
        r = json.loads((records / f"{label}.json").read_text())
        (records / f"{label}.json").write_text(json.dumps({**r, "config": want}))
    shutil.rmtree(root)  # the run folders are gone: the records stand for them
    again = ab.run_smollm2(False, train_missing=False)
    assert again["rows"] == first["rows"] and again["summary"] == first["summary"]
    assert "the record of" in capsys.readouterr().out

    # a record of another config is named and run again, with its record replaced
    r = json.loads((records / "sync-seed0.json").read_text())
    r["config"]["trainer"]["eta"] = 4
    (records / "sync-seed0.json").write_text(json.dumps(r))
    (records / "eta8-decoupled-seed1.json").write_text(json.dumps({**r, "sets": ["trainer.eta=8"]}))
    with pytest.raises(FileNotFoundError):  # the fake train makes no run folder
        ab.run_smollm2(False)
    out = capsys.readouterr().out
    assert "sync-seed0.json: not reused (trainer.eta: 4 != 0)" in out and trained == ["sync-seed0"]
    assert ab.run_smollm2(False, train_missing=False)["rows"] == []  # neither record reused
    assert "eta8-decoupled-seed1.json: not reused (settings ['trainer.eta=8'] !=" in capsys.readouterr().out


def test_config_difference_names_the_first_differing_key():
    assert ab.config_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == "a.c: 2 != 3"
    assert ab.config_difference({"a": {"b": 1}}, {"a": {"b": 1, "new": 0}}) is None  # added since: not compared
    assert ab.config_difference({"gone": 1}, {"a": 1}) == "gone: no longer a config key"
