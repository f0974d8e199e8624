"""The cost ledger's arithmetic (areal_core/run/costs.py) against hand-computed figures."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from areal_core.experiment import CostConfig
from areal_core.run.costs import CostLedger, summary


def figures(busy, gate, again=0, n=2):
    return {"busy_s": busy, "gate_wait_s": gate, "reprefilled_tokens": again, "n_servers": n}


ROW = {
    "step": 1,
    "step_time_s": 2.0,
    "wait_time_s": 0.5,
    "reward_wait_s": 0.2,
    "train_time_s": 1.0,
    "publish_time_s": 0.3,
    "checkpoint_time_s": 0.1,
}


def test_stages_add_up_to_each_pools_time():
    led = CostLedger(CostConfig(usd_per_device_hour={"rollout": 2.0, "trainer": 4.0}))
    led.start(figures(10.0, 1.0, 100))
    c = led.step_row(ROW, figures(12.5, 1.5, 160), generated=300)
    trainer = {k: v for k, v in c.items() if k.startswith("cost_trainer_")}
    assert trainer == pytest.approx(
        {
            "cost_trainer_training_s": 1.0,
            "cost_trainer_weight_sync_s": 0.3,
            "cost_trainer_waiting_grades_s": 0.2,
            "cost_trainer_waiting_rollout_s": 0.3,
            "cost_trainer_checkpoint_s": 0.1,
            "cost_trainer_other_s": 0.1,
        }
    )
    assert sum(trainer.values()) == pytest.approx(2.0)
    # 2 servers x 2 s = 4 s: 2.5 s generating, the gate held admission 0.5 s (x 2 servers), the rest idle
    assert (c["cost_rollout_generating_s"], c["cost_rollout_gate_s"], c["cost_rollout_idle_s"]) == pytest.approx(
        (2.5, 1.0, 0.5)
    )
    assert c["cost_reprefilled_tokens"] == 60 and c["cost_generated_tokens"] == 300
    assert c["cost_usd"] == pytest.approx(2.0 / 3600 * (2 * 2.0 + 4.0))


def test_a_provisional_row_leaves_the_next_rows_figures_alone():
    led = CostLedger(CostConfig())
    led.start(figures(10.0, 0.0))
    early = led.step_row(ROW, figures(11.0, 0.0), generated=0, commit=False)  # a checkpoint's copy
    final = led.step_row(ROW, figures(12.0, 0.0), generated=0)
    assert (early["cost_rollout_generating_s"], final["cost_rollout_generating_s"]) == (1.0, 2.0)
    nxt = led.step_row(ROW, figures(13.0, 0.0), generated=0)
    assert nxt["cost_rollout_generating_s"] == 1.0  # from the final row's figures on


def test_a_restarted_server_and_an_unknown_busy_time():
    led = CostLedger(CostConfig())
    led.start(figures(50.0, 0.0))
    c = led.step_row(ROW, figures(1.5, 0.0), generated=0)  # counters went back: the server restarted
    assert c["cost_rollout_generating_s"] == 1.5 and math.isnan(c["cost_usd"])
    c = led.step_row(ROW, figures(None, 0.0, None), generated=0)  # a server that does not report it
    assert math.isnan(c["cost_rollout_generating_s"]) and math.isnan(c["cost_rollout_idle_s"])


def test_budget_and_summary():
    cfg = CostConfig(usd_per_device_hour={"rollout": 3600.0, "trainer": 0.0}, budget_usd=5.0)
    led = CostLedger(cfg)
    led.start(figures(0.0, 0.0, n=1))
    rows = []
    for step in (1, 2, 3):
        rows.append({**ROW, "step": step, **led.step_row(ROW, figures(float(step), 0.0, n=1), generated=10)})
        assert led.budget_spent(rows) == (step >= 3)  # 2 s a step at 1 USD a second: 2, 4, 6 USD
    s = summary(rows, wall_s=10.0, setup_s=3.0, rl_s=6.5, tokens_trained=20, generated_tokens=30, cfg=cfg, n_servers=1)
    assert s["phases_s"] == pytest.approx({"setup": 3.0, "steps": 6.0, "between_steps": 0.5, "after": 0.5})
    assert s["accounted_share"] == pytest.approx(1.0) and s["tokens"]["never_trained"] == 10
    assert s["usd_steps"] == pytest.approx(6.0) and s["usd"] == pytest.approx(10.0)


def test_a_budget_needs_prices():
    with pytest.raises(ValidationError, match=r"budget_usd needs cost\.usd_per_device_hour"):
        CostConfig(budget_usd=5.0)


def test_the_planner_shows_a_runs_ledger_in_its_own_stage_names(tmp_path):
    import json

    from areal_core.run.costs import describe_shares, shares
    from areal_core.sim.request import _ledger_lines

    totals = {
        "rollout_s": {"generating": 60.0, "gate": 30.0, "idle": 10.0},
        "trainer_s": {
            "training": 75.0,
            "weight_sync": 5.0,
            "waiting_grades": 0.0,
            "waiting_rollout": 20.0,
            "checkpoint": 0.0,
            "other": float("nan"),
        },
    }
    by_pool = shares(totals)
    assert by_pool["rollout"] == {"generating": 0.6, "gate": 0.3, "idle": 0.1}
    assert by_pool["trainer"]["training"] == 0.75 and "other" not in by_pool["trainer"]  # unmeasured: left out
    assert describe_shares(by_pool).startswith("rollout: generating 60%, gate 30%, idle 10%; trainer: training 75%")
    (tmp_path / "summary.json").write_text(json.dumps({"cost": totals}))
    assert "rollout: generating 60%" in _ledger_lines(str(tmp_path))
    (tmp_path / "summary.json").write_text(json.dumps({}))
    assert "has no cost ledger" in _ledger_lines(str(tmp_path))
