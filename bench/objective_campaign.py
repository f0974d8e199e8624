"""The objective ablation on SmolLM2-135M-Instruct as a campaign that decides: ``python -m bench
objective_campaign``. The SmolLM2 quickstart (configs/smollm2_quickstart.yaml, 40 steps) in seven
named settings on paired seeds, each decided against asynchronous decoupled PPO at eta 8 by held-out
accuracy after RL (bench/campaigns.py):

* ``sync``: eta 0, the servers drained for every weight update;
* ``eta8-naive``: eta 8, plain PPO clipped against the behaviour policy;
* ``eta8-decoupled`` (the baseline): eta 8, decoupled PPO;
* ``eta8-decoupled-icepop`` / ``-tis`` / ``-m2po``: the baseline with each replacement of its
  behaviour weight (``trainer.off_policy``, docs/RL_TUNING.md), at the kind's defaults;
* ``eta8-decoupled-bf16-servers``: the baseline with its rollout servers in bfloat16 beside a
  float32 trainer (the engine-vs-trainer mismatch of large deployments; its logprob gap is in the
  runs' metrics).

Every setting's trainer computes in float32 (``model.dtype: float32``), so the last setting differs
from the baseline in the servers' precision only. 3 seeds of every setting first, then a seed more of
the baseline and of each setting whose difference is unclear (its 95 % interval neither excludes 0
nor lies within +-0.02), up to 5 seeds. A float32 run takes about 25-30 minutes on 2 cores with AVX-512 BF16, so the
first 21 runs take about 10 hours; the campaign resumes (rerun the command over the same folder: the
finished runs of the same config and commit are reused, and the run it was stopped in continues from
its latest checkpoint), so it can be run in several sittings from one fixed commit.

--quick: one seed of 3 steps per setting, no seeds added: a smoke check.
"""

from __future__ import annotations

from bench.campaigns import run_campaign

CONFIG = "configs/smollm2_quickstart.yaml"
BASELINE = "eta8-decoupled"
ETA8 = "trainer.eta: 8, trainer.objective: decoupled, model.dtype: float32"
SETTINGS = {
    "sync": "{trainer.eta: 0, rollout.weight_update: drain, model.dtype: float32}",
    "eta8-naive": "{trainer.eta: 8, trainer.objective: naive, model.dtype: float32}",
    BASELINE: "{" + ETA8 + "}",
    **{f"{BASELINE}-{kind}": "{" + ETA8 + f", trainer.off_policy: {kind}" + "}" for kind in ("icepop", "tis", "m2po")},
    f"{BASELINE}-bf16-servers": "{" + ETA8 + ", rollout.dtype: bfloat16, rollout.request_timeout_s: 3600}",
}


def run(quick: bool) -> dict:
    options = (
        ["--seeds", "1", "--max-steps", "3"]
        if quick
        else ["--seeds", "3", "--until-clear", "--max-seeds", "5", "--margin", "0.02"]
    )
    name = "objective_campaign_quick" if quick else "objective_campaign"
    return run_campaign(name, CONFIG, SETTINGS, BASELINE, options)
