"""Which precision learns best on this CPU: SmolLM2-135M-Instruct's quickstart (eta 4,
configs/smollm2_quickstart.yaml) in three settings side by side, as a campaign on paired seeds
(bench/campaigns.py), decided by held-out accuracy after RL against float32:

* ``float32``: the trainer and the rollout servers compute in float32;
* ``bfloat16``: both in bfloat16, the trainer with float32 master weights;
* ``f32-trainer-bf16-servers``: the trainer in float32, the servers in bfloat16.

It measures, on one machine and one commit, which precision a CPU's bf16 matrix units should serve:
``model.dtype: auto`` follows its outcome on such a CPU (a float32 trainer, bfloat16 servers:
``areal_core.device``). Its ``bfloat16`` rows are also the quickstart's gains on the honest held-out
split as it ran by default before that rule.

--quick: one seed of 4 steps per setting: a smoke check.
"""

from __future__ import annotations

from bench.campaigns import run_campaign

CONFIG = "configs/smollm2_quickstart.yaml"
SETTINGS = {
    "float32": "{model.dtype: float32}",
    "bfloat16": "{model.dtype: bfloat16}",
    "f32-trainer-bf16-servers": "{model.dtype: float32, rollout.dtype: bfloat16}",
}
SEEDS = 3


def run(quick: bool) -> dict:
    options = ["--seeds", "1", "--max-steps", "4"] if quick else ["--seeds", str(SEEDS)]
    return run_campaign("dtype_control_quick" if quick else "dtype_control", CONFIG, SETTINGS, "float32", options)
