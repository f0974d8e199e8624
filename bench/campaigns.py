"""Shared by the benchmarks that are campaigns (``areal-flow campaign --setting ...``): run one into
its folder under runs/bench/, then its decision and every run's figures as the record.

A campaign trains every setting on paired seeds (seed k: the same data order, warm start and sampling
keys in every setting) and takes each setting's paired difference to the baseline with a 95 %
interval; run again over the same folder it reuses the runs of the same config and code and continues
the run it was stopped in from that run's latest checkpoint. The record
holds the decision (``decision.json``) and, per run, its accuracy before and after RL, the share of
answers in a form graded, and its wall time and tokens/s (which say nothing across settings where the
machine was shared).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from bench.common import REPO_ROOT, RUNS_DIR, format_table
from bench.learning import say


def _run_row(label: str, seed: str, run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "setting": label,
        "seed": int(seed),
        "run_dir": str(run_dir),
        "dtype": s["dtype"],
        "rollout_dtype": s["rollout_dtype"],
        "eta": s["eta"],
        "objective": s["objective"],
        "before": s["accuracy_before"],
        "after": s["accuracy_after"],
        "answered_before": s.get("answered_before"),
        "answered_after": s.get("answered_after"),
        "run_wall_s": s["wall_time_s"],  # (of the last sitting only where the run was continued)
        "resumed_from_step": s.get("resumed_from_step"),
        "tokens_per_s": s["effective_train_tokens_per_s"],
        "max_staleness": s["max_staleness_observed"],
        "code": s["code"],
    }


def interval(x: dict | None, sign: str = "") -> str:
    """A campaign interval as ``mean [lo, hi]`` (the mean alone from one seed); "-" for none."""
    if x is None:
        return "-"
    if x["n"] < 2:
        return f"{x['mean']:{sign}.3f} (1 seed)"
    return f"{x['mean']:{sign}.3f} [{x['lo']:{sign}.3f}, {x['hi']:{sign}.3f}]"


def run_campaign(name: str, config: str, settings: dict[str, str], baseline: str, options: list[str]) -> dict:
    """``areal-flow campaign CONFIG --setting LABEL=KEYS ... --baseline BASELINE OPTIONS`` into
    runs/bench/NAME/campaign; the record (see the module docstring)."""
    out = RUNS_DIR / name / "campaign"
    cmd = [str(REPO_ROOT / ".venv/bin/areal-flow"), "campaign", config, "--out", str(out), "--baseline", baseline]
    for label, keys in settings.items():
        cmd += ["--setting", f"{label}={keys}"]
    cmd += options
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
    table = [
        [s["label"], s["outcome"]["n"], interval(s["outcome"]), interval(s["difference"], "+"), s["verdict"]]
        for s in decision["settings"]
    ]
    print(format_table(["setting", "seeds", decision["outcome_label"], f"difference to {baseline}", "verdict"], table))
    print(f"stopped because: {decision['stopped_because']}")
    return {
        "config": config,
        "settings": settings,
        "campaign_command": " ".join(["areal-flow", *cmd[1:]]),
        "campaign_wall_s": time.perf_counter() - t0,
        "decision": decision,
        "rows": rows,
    }
