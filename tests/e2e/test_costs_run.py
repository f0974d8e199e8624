"""A run's cost ledger end to end: stage times that add up to the wall time, and a budget that stops
the run at a checkpoint, from which a raised budget resumes with every trajectory trained once."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from areal_core.experiment import load_config
from areal_core.run.setup import RunStopped, run_experiment

HERE = Path(__file__).resolve().parents[1]
# 1 USD per second of a rollout server: the first step spends the budget of 0.01 USD
PRICED = {
    "cost.usd_per_device_hour": {"rollout": 3600.0, "trainer": 0.0},
    "trainer.max_steps": 5,
    "storage.checkpoint_every": 2,
}


@pytest.mark.nightly
def test_a_budget_stops_at_a_checkpoint_and_a_raised_one_resumes(tmp_path, warm_cache):
    run = tmp_path / "run"
    cfg = load_config(HERE / "data/e2e.yaml", {**PRICED, "cost.budget_usd": 0.01})
    with pytest.raises(RunStopped, match=r"stopped at step 2: cost.budget_usd \(0.01 USD\) spent") as stop:
        run_experiment(cfg, run, progress=False, cache_dir=warm_cache)
    assert stop.value.step == 2 and (run / "checkpoints/v2/manifest.json").is_file()
    assert not (run / "checkpoints/v3").exists()

    cfg = load_config(HERE / "data/e2e.yaml", {**PRICED, "cost.budget_usd": 1000.0})
    s = run_experiment(cfg, run, progress=False, cache_dir=warm_cache, resume=True)
    assert s["resumed_from_step"] == 2 and s["steps"] == 5 and s["ledger_check"]["ok"]
    c = s["cost"]
    assert c["accounted_share"] == pytest.approx(1.0, abs=0.05)  # phases and steps: the wall time
    assert sum(c["phases_s"].values()) == pytest.approx(c["wall_s"], rel=0.05)
    assert c["rollout_s"]["generating"] > 0 and c["trainer_s"]["training"] > 0 and c["usd"] > 0
    costs = pd.read_parquet(run / "costs.parquet")
    assert list(costs["step"]) == [1, 2, 3, 4, 5]  # the stopped run's steps kept by the resume (step 2's checkpoint)
    # the stopped run's last row is whole in the checkpoint it resumed from (its times and costs)
    assert costs.notna().all().all(), costs[costs.isna().any(axis=1)]
    stages = costs.filter(like="cost_trainer_").sum(axis=1)
    assert (stages - costs["step_time_s"]).abs().max() < 1e-6  # the trainer's stages are each step's wall time
    # checkpoints at 2 (the stop), 4 and 5; step 2's row as its own checkpoint holds it, before the write
    assert (costs["cost_trainer_checkpoint_s"] > 0).tolist() == [False, False, False, True, True]
    assert json.loads((run / "summary.json").read_text())["cost"]["budget_usd"] == 1000.0
