"""Which precision learns best on this CPU: SmolLM2-135M-Instruct's quickstart (eta 4,
configs/smollm2_quickstart.yaml) in three settings side by side, as a campaign on paired seeds
(``areal-flow campaign --setting ...``: seed k is the same data order, warm start and sampling keys in
every setting), decided by held-out accuracy after RL against float32:

* ``float32``: the trainer and the rollout servers compute in float32;
* ``bfloat16``: both in bfloat16, the trainer with float32 master weights;
* ``f32-trainer-bf16-servers``: the trainer in float32, the servers in bfloat16.

``model.dtype: auto`` picks bfloat16 where the CPU has bf16 matrix units; this measures, on one machine
and one commit, whether that is the better choice there. Each run's figures (accuracy and, apart from
it, the share of answers in a form graded; wall time; tokens/s) and the campaign's paired intervals go
into the record. The campaign folder is kept (runs/bench/dtype_control/campaign): run again, it reuses
the runs of the same config and code.

--quick: one seed of 4 steps per setting: a smoke check.
"""

from __future__ import annotations

import json
import subprocess
import time

from bench.common import REPO_ROOT, RUNS_DIR, format_table
from bench.learning import say

CONFIG = "configs/smollm2_quickstart.yaml"
SETTINGS = {
    "float32": "{model.dtype: float32}",
    "bfloat16": "{model.dtype: bfloat16}",
    "f32-trainer-bf16-servers": "{model.dtype: float32, rollout.dtype: bfloat16}",
}
SEEDS = 3


def _command(out, quick: bool) -> list[str]:
    cmd = [str(REPO_ROOT / ".venv/bin/areal-flow"), "campaign", CONFIG, "--out", str(out), "--baseline", "float32"]
    cmd += ["--seeds", "1" if quick else str(SEEDS)]
    if quick:
        cmd += ["--max-steps", "4"]
    for label, keys in SETTINGS.items():
        cmd += ["--setting", f"{label}={keys}"]
    return cmd


def _run_row(label: str, seed: str, run_dir) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "setting": label,
        "seed": int(seed),
        "run_dir": str(run_dir),
        "dtype": s["dtype"],
        "rollout_dtype": s["rollout_dtype"],
        "before": s["accuracy_before"],
        "after": s["accuracy_after"],
        "answered_before": s.get("answered_before"),
        "answered_after": s.get("answered_after"),
        "run_wall_s": s["wall_time_s"],
        "tokens_per_s": s["effective_train_tokens_per_s"],
        "max_staleness": s["max_staleness_observed"],
        "code": s["code"],
    }


def _iv(x: dict | None, sign: str = "") -> str:
    """A campaign interval as ``mean [lo, hi]`` (the mean alone from one seed); "-" for none."""
    if x is None:
        return "-"
    if x["n"] < 2 or x["lo"] is None:
        return f"{x['mean']:{sign}.3f}"
    return f"{x['mean']:{sign}.3f} [{x['lo']:{sign}.3f}, {x['hi']:{sign}.3f}]"


def run(quick: bool) -> dict:
    out = RUNS_DIR / ("dtype_control_quick" if quick else "dtype_control") / "campaign"
    cmd = _command(out, quick)
    log = out.parent / "campaign.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"{' '.join(cmd[1:])}\n(log: {log})")
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"the campaign exited with {rc}; see {log}")
    decision = json.loads((out / "decision.json").read_text())
    rows = [
        _run_row(s["label"], seed, out / f"{s['label']}-s{seed}") for s in decision["settings"] for seed in s["by_seed"]
    ]
    table = []
    for s in decision["settings"]:
        mine = [r for r in rows if r["setting"] == s["label"]]
        table.append(
            [
                s["label"],
                s["outcome"]["n"],
                _iv(s["outcome"]),
                _iv(s["difference"], "+"),
                s["verdict"],
                f"{sum(r['tokens_per_s'] for r in mine) / len(mine):,.0f}",
            ]
        )
    print(format_table(["setting", "seeds", "held-out after", "difference to float32", "verdict", "tokens/s"], table))
    return {
        "config": CONFIG,
        "settings": SETTINGS,
        "campaign_command": " ".join(["areal-flow", *cmd[1:]]),
        "campaign_wall_s": time.perf_counter() - t0,
        "decision": decision,
        "rows": rows,
    }
