"""A campaign that decides, on the tiny quickstart (configs/quickstart.yaml, 300 steps): synchronous
(eta 0) against asynchronous at eta 4 (decoupled PPO) and at eta 8 with the naive objective (no
correction for staleness), the synchronous run draining the servers for each update as
bench/learning.py's SYNC does; 3 paired seeds first, then a seed more of eta 0 and of each setting whose
difference to it is unclear (its 95 % interval neither excludes 0 nor lies within +-0.02), up to 8
seeds or 45 minutes (bench/campaigns.py). Decided by held-out accuracy after RL.

--quick: 2 seeds of 20 steps, no seeds added: a smoke check.
"""

from __future__ import annotations

from bench.campaigns import run_campaign

CONFIG = "configs/quickstart.yaml"
SETTINGS = {
    "eta0": "{trainer.eta: 0, rollout.weight_update: drain}",
    "eta4-decoupled": "{trainer.eta: 4, trainer.objective: decoupled}",
    "eta8-naive": "{trainer.eta: 8, trainer.objective: naive}",
}


def run(quick: bool) -> dict:
    options = (
        ["--seeds", "2", "--max-steps", "20"]
        if quick
        else ["--seeds", "3", "--until-clear", "--max-seeds", "8", "--max-minutes", "45", "--margin", "0.02"]
    )
    return run_campaign("eta_until_clear_quick" if quick else "eta_until_clear", CONFIG, SETTINGS, "eta0", options)
