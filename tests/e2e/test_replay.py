"""Exact replay of an asynchronous run from its recorded schedule, counterfactual replays, and
synchronous runs that repeat bit for bit (docs/OPERATIONS.md, "Debugging a run")."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from areal_core.experiment import load_config
from areal_core.run.setup import run_experiment
from flows.cli import main

HERE = Path(__file__).resolve().parents[1]
# a tiny model warm-started far enough to get some answers right: its gradients are not zero
LEARNS = {"model.warm_start.steps": 300, "model.warm_start.lr": 0.003, "data.synthetic.max_chain": 3}


def train(run_dir: Path, cache: str, **overrides) -> pd.DataFrame:
    cfg = load_config(HERE / "data/e2e.yaml", {**LEARNS, **overrides})
    run_experiment(cfg, run_dir, progress=False, cache_dir=cache)
    return pd.read_parquet(run_dir / "metrics.parquet")


@pytest.fixture(scope="module")
def original(tmp_path_factory, warm_cache, shared_rewards) -> Path:
    """An asynchronous run (eta 2, in-flight weight updates): 8 steps, checkpoints v0, v3, v6, v8."""
    run = tmp_path_factory.mktemp("replay") / "original"
    m = train(run, warm_cache, **shared_rewards)
    assert (m["grad_norm"] > 0).sum() >= 4  # it trains: a replay that matched nothing-happened would prove nothing
    return run


def replay(capsys, *args) -> tuple[int, list[str]]:
    rc = main(["replay", *map(str, args), "--no-prefect"])
    return rc, [line for line in capsys.readouterr().out.splitlines() if line.startswith("v")]


def test_an_async_run_replays_bit_for_bit(original, tmp_path, capsys):
    rc, lines = replay(capsys, original, "--out", tmp_path / "r")
    assert rc == 0
    assert [line.split()[0] for line in lines] == ["v3", "v6", "v8"] and all(line.endswith(" match") for line in lines)
    a, b = pd.read_parquet(original / "metrics.parquet"), pd.read_parquet(tmp_path / "r/metrics.parquet")
    for key in ("loss", "grad_norm", "clip_fraction", "behav_weight_mean"):
        assert a[key].tolist() == b[key].tolist(), key  # every step, exactly
    assert (original / "schedule/step-000008.parquet").is_file() and (a["schedule_bytes"] > 0).all()
    # the trainer and the replay both computed with MKL in its thread-independent mode, and say on what
    meta = json.loads((original / "schedule/meta.json").read_text())
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert meta["numerics"]["mkl_mode"] in (None, "AUTO,STRICT") and meta["numerics"] == summary["recorded_on"]
    assert summary["replayed_on"]["mkl_mode"] == meta["numerics"]["mkl_mode"] and summary["same_kernels"]
    assert (tmp_path / "r/checkpoints/v8").is_dir() and (tmp_path / "r/replay.png").stat().st_size > 5000
    # on two threads where the original trainer had one: the same weights (its arithmetic does not
    # depend on the thread count), and the test process's own thread count is left as it was
    rc, lines2 = replay(capsys, original, "--out", tmp_path / "r2", "--threads", 2)
    assert rc == 0 and lines2 == lines and torch.get_num_threads() == 1
    # a middle checkpoint as the start
    rc, lines = replay(capsys, original, "--out", tmp_path / "mid", "--from-step", 3, "--to-step", 6)
    assert rc == 0 and lines == [lines[0]] and lines[0].startswith("v6 ") and lines[0].endswith(" match")


def test_a_changed_batch_is_caught(original, tmp_path, capsys):
    """A replay whose step 5 trains other data (one reward changed) says where it parted from the
    original (step 5's loss) and by how much (the first tensor, the largest differences), stops at
    v6 with rc 1; with --tolerant it trains on and says how far the final weights drifted."""
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(original, copy)
    path = copy / "schedule/step-000005.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows[0]["reward"] = -rows[0]["reward"] if rows[0]["reward"] else 1.0
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), path)
    rc = main(["replay", str(copy), "--out", str(tmp_path / "r"), "--no-prefect"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert out[0].startswith("recorded and replayed on ") and "the same kernels" in out[0]
    first = next(i for i, line in enumerate(out) if line.startswith("step "))
    assert out[first].startswith("step 5: first difference from the original: loss ")
    assert out[first - 1].startswith("v3 ") and out[first - 1].endswith(" match")
    assert out[first + 1].startswith("v6 ") and out[first + 1].endswith(" DIFFERS")
    assert out[first + 2].startswith("v6: ") and " tensors differ, first " in out[first + 2]
    assert "relative L2 distance" in out[first + 2]
    assert out[first + 3].startswith("stopped at v6")
    assert not any(line.startswith("v8") for line in out)  # it stopped
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["first_difference"]["step"] == 5 and summary["first_difference"]["figure"] == "loss"
    assert summary["checkpoints"][-1]["weights"]["tensors_differing"] > 0 and summary["final_distance"] is None

    rc = main(["replay", str(copy), "--out", str(tmp_path / "t"), "--no-prefect", "--tolerant"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1 and not any(line.startswith("stopped at") for line in out)
    assert any(line.startswith("v8 ") and line.endswith(" DIFFERS") for line in out)
    drift = json.loads((tmp_path / "t/summary.json").read_text())["final_distance"]
    assert drift["max_abs"] > 0 and 0 < drift["relative_l2"] < 1


def test_a_counterfactual_replay_says_so(original, tmp_path, capsys):
    import json

    rc, lines = replay(capsys, original, "--out", tmp_path / "cf", "--set", "trainer.objective=naive")
    assert rc == 0 and all("differs from the original (counterfactual)" in line for line in lines)
    s = json.loads((tmp_path / "cf/summary.json").read_text())
    assert s["replay"]["counterfactual"] and "not an on-policy run" in s["replay"]["note"]
    assert json.loads((tmp_path / "cf/config.json").read_text())["trainer"]["objective"] == "naive"


def test_replay_refuses_what_it_cannot_do(original, tmp_path, capsys):
    assert (
        main(["replay", str(original), "--out", str(tmp_path / "x"), "--set", "rollout.n_servers=2", "--no-prefect"])
        == 2
    )
    assert "may change the trainer's settings only" in capsys.readouterr().err
    assert main(["replay", str(original), "--out", str(tmp_path / "y"), "--from-step", "4", "--no-prefect"]) == 2
    assert "has no checkpoint v4 (it has v0, v3, v6, v8)" in capsys.readouterr().err


@pytest.mark.nightly
@pytest.mark.parametrize("servers", [1, 2])
def test_a_synchronous_run_repeats_bit_for_bit(tmp_path, warm_cache, servers):
    """eta 0 and drained updates, nothing else asked for: two runs with one seed, with a curriculum
    that learns from finished groups, and the second beside two busy loops, give the same metrics
    (timings aside) and the same weights at every checkpoint (a synchronous run is deterministic by
    default: batch-invariant servers, the curriculum fed in admission order)."""
    from bench.determinism import busy_loops

    sync = {
        "trainer.eta": 0,
        "rollout.weight_update": "drain",
        "rollout.n_servers": servers,
        "data.curriculum": {"by": "k"},
    }
    a = train(tmp_path / "run1", warm_cache, **sync)
    with busy_loops(2):
        b = train(tmp_path / "run2", warm_cache, **sync)
    cfg = json.loads((tmp_path / "run1/config.json").read_text())["rollout"]
    assert cfg["deterministic"] is True and cfg["batch_invariant"] is True
    hashes = a["weights_sha256"].dropna().tolist()
    assert len(hashes) == 3 and hashes == b["weights_sha256"].dropna().tolist()
    # timings, and the tokens the servers happened to generate while each step trained
    timing = [
        c for c in a.columns if c.endswith(("_s", "generated_tokens")) or "per_s" in c or c == "cost_reprefilled_tokens"
    ]
    assert len(a.columns) - len(timing) > 20
    differ = [c for c in a.columns if c not in timing and not a[c].equals(b[c])]
    assert not differ, {c: (a[c].tolist(), b[c].tolist()) for c in differ}


@pytest.mark.nightly
def test_a_deterministic_async_run_repeats_bit_for_bit(tmp_path, warm_cache):
    """rollout.deterministic at eta 2 with in-flight weight updates: two runs with one seed train the
    same trajectories at the same versions, so every checkpoint's weights are equal, and the
    staleness still reaches eta (asynchronous, not synchronous)."""
    det = {"rollout.deterministic": True, "rollout.batch_invariant": True, "rollout.n_servers": 2}
    a, b = (train(tmp_path / f"run{i}", warm_cache, **det) for i in (1, 2))
    hashes = a["weights_sha256"].dropna().tolist()
    assert len(hashes) == 3 and hashes == b["weights_sha256"].dropna().tolist()
    assert a["staleness_max"].max() == 2
    la, lb = (pd.read_parquet(tmp_path / f"run{i}/ledger.parquet") for i in (1, 2))
    assert la[["trajectory_id", "step", "min_token_version", "max_token_version"]].equals(
        lb[["trajectory_id", "step", "min_token_version", "max_token_version"]]
    )
