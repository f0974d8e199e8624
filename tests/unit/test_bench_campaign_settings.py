"""The campaign benchmarks' named settings are what `areal-flow campaign --setting` accepts and give
valid configs (checked as the campaign checks them before it runs anything), and each benchmark's
baseline is one of its settings."""

from __future__ import annotations

import pytest

from areal_core.experiment import load_config
from areal_core.run.sweep import named_points, validate_points
from bench import dtype_control, eta_until_clear, objective_campaign
from flows.cli_input import settings_from


@pytest.mark.parametrize(
    "mod, baseline",
    [(dtype_control, "float32"), (eta_until_clear, "eta0"), (objective_campaign, objective_campaign.BASELINE)],
)
def test_campaign_settings_are_valid_configs(mod, baseline):
    settings = settings_from([f"{label}={text}" for label, text in mod.SETTINGS.items()])
    points = named_points(settings)
    assert [label for label, _ in points] == list(mod.SETTINGS) and baseline in mod.SETTINGS
    validate_points(str(mod.CONFIG), points)


def test_the_objective_ablation_differs_from_its_baseline_in_one_thing_each():
    settings = settings_from([f"{label}={text}" for label, text in objective_campaign.SETTINGS.items()])
    cfgs = {label: load_config(objective_campaign.CONFIG, ov) for label, ov in settings.items()}
    base = cfgs[objective_campaign.BASELINE]
    assert (base.trainer.eta, base.trainer.objective, base.model.dtype) == (8, "decoupled", "float32")
    assert base.trainer.off_policy.kind == "none"
    for kind in ("icepop", "tis", "m2po"):
        c = cfgs[f"eta8-decoupled-{kind}"]
        assert (
            c.trainer.off_policy.kind == kind
            and c.trainer.model_copy(update={"off_policy": base.trainer.off_policy}) == base.trainer
        )
    assert cfgs["eta8-naive"].trainer.objective == "naive"
    assert (cfgs["sync"].trainer.eta, cfgs["sync"].rollout.weight_update) == (0, "drain")
    bf16 = cfgs["eta8-decoupled-bf16-servers"]
    assert (bf16.model.dtype, bf16.rollout.dtype) == ("float32", "bfloat16") and bf16.trainer == base.trainer
    assert all(c.model.dtype == "float32" for c in cfgs.values())
