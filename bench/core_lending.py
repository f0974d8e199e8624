"""What core lending gives an asynchronous run, and what the trainer's idle OpenMP threads take
back: ``python -m bench core_lending [--model smollm2] [--quick]``.

The tiny model's workload of ``bench trl_peer`` at P8 x G4, 64 new tokens (bench/trl_peer_inputs.py),
or with ``--model smollm2`` the workload of ``bench trl_peer_smollm2`` (SmolLM2-135M-Instruct, 8 x 8
answers, 40 new tokens, in the CPU's matrix dtype), areal-flow asynchronous (eta 4) as those
benchmarks run it, four ways, each run in a fresh process:

* ``lending off``: the trainer computes on the cores the rollout server leaves it
  (``trainer.lend_idle_cores: false``);
* ``lending on``: it also borrows the server's core while no generate request is in flight, in the
  steps that follow a step in which the server was idle in at least half of the trainer's layer
  passes (trainer/core_lending.py, ``trainer.lend_min_idle_share`` at its default), and in any
  step while the server is idle with admission held at the staleness gate, as ``bench trl_peer``
  runs it;
* ``lending at every idle moment``: it borrows whenever no request is in flight, whatever the step
  before was like (``trainer.lend_min_idle_share: 0``);
* ``every idle moment, passive OpenMP waits``: the same in a process started with
  ``OMP_WAIT_POLICY=PASSIVE``, which the OpenMP runtime reads once, at start. When the trainer goes
  back to its own threads, the thread it stops using then sleeps at once; by default it first spins
  for a while, on the core the server is about to use.

The ways interleave (off, on, every moment, passive, then again), REPS repetitions of STEPS steps (SmolLM2:
REPS_SMOLLM2 of STEPS_SMOLLM2) of which WARMUP are excluded. Per run: effective train tokens/s,
seconds a step and of it training and waiting for answers, and the shares of the trainer's layer
passes that found the server idle and that ran on lent cores; per repetition, each way's tokens/s over lending off's.
--quick: one repetition of fewer steps, a smoke check.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import REPO_ROOT, format_table, work_dir
from bench.trl_peer_inputs import WARMUP

P, G, T = 8, 4, 64
STEPS_FULL, STEPS_QUICK = 30, 10
REPS_FULL, REPS_QUICK = 3, 1
STEPS_SMOLLM2, REPS_SMOLLM2 = 8, 2  # a SmolLM2 run of 8 steps takes about 2.5 minutes on 2 cores
_WORKLOADS = {
    "tiny": f"bench trl_peer's tiny model, P{P} x G{G}, T {T}",
    "smollm2": "bench trl_peer_smollm2's SmolLM2-135M-Instruct, P8 x G8, T 40",
}
OFF, ON, EVERY = "lending off", "lending on", "lending at every idle moment"
PASSIVE = "every idle moment, passive OpenMP waits"
# way: (trainer.lend_idle_cores, trainer.lend_min_idle_share (None: its default), the process's environment)
WAYS = {
    OFF: (False, None, {}),
    ON: (True, None, {}),
    EVERY: (True, 0.0, {}),
    PASSIVE: (True, 0.0, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def run_way(way: str, model: str, root: Path, steps: int) -> dict:
    """One asynchronous run of ``model``'s workload the ``way`` says, in this process (the module run
    as a script)."""
    import pandas as pd

    from areal_core.run.setup import run_experiment
    from bench.trl_peer_inputs import areal_config, prepare_tiny, smollm2_workload, tiny_workload
    from bench.trl_peer_systems import step_parts

    if model == "smollm2":
        w = smollm2_workload(root / "inputs", steps)[0]
    else:
        w = tiny_workload(prepare_tiny(root / "inputs"), P, G, T, steps)
    cfg = areal_config("async", w, None)
    lend, min_idle_share, _ = WAYS[way]
    cfg.trainer.lend_idle_cores = lend
    if min_idle_share is not None:
        cfg.trainer.lend_min_idle_share = min_idle_share
    run_dir = root / "run"
    summary = run_experiment(cfg, run_dir, max_steps=steps, progress=False)
    m = pd.read_parquet(run_dir / "metrics.parquet").sort_values("step")
    lent = m["trainer_lent_share"].iloc[WARMUP:].dropna()
    idle = m["trainer_idle_share"].iloc[WARMUP:].dropna()
    return {
        "effective_train_tokens_per_s": summary["effective_train_tokens_per_s"],
        "mean_step_s": float(m["step_time_s"].iloc[WARMUP:].mean()),
        **step_parts(m),
        "idle_share": float(idle.mean()) if len(idle) else None,  # (None: lending off, not counted)
        "lent_share": float(lent.mean()) if len(lent) else 0.0,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "run_dir": str(run_dir),
    }


def idle_cell(runs) -> str:
    """The mean share of layer passes that found the server idle ("-": not counted, lending off)."""
    shares = [x["idle_share"] for x in runs if x.get("idle_share") is not None]
    return f"{statistics.fmean(shares):.2f}" if shares else "-"


def _in_fresh_process(way: str, model: str, root: Path, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(WAYS[way][2])
    out = subprocess.run(
        [sys.executable, "-m", "bench.core_lending", way, model, str(root), str(steps)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"core_lending run '{way}' failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool, model: str = "tiny") -> dict:
    root = work_dir("core_lending" + ("" if model == "tiny" else f"_{model}"), quick)
    steps, reps = (STEPS_QUICK, REPS_QUICK) if quick else (STEPS_FULL, REPS_FULL)
    if model == "smollm2" and not quick:
        steps, reps = STEPS_SMOLLM2, REPS_SMOLLM2
    repetitions = []
    for r in range(reps):
        runs = {}
        for i, way in enumerate(WAYS):
            print(f"core_lending repetition {r + 1}/{reps}: {way}, {steps} steps ...", flush=True)
            runs[way] = _in_fresh_process(way, model, root / f"rep{r + 1}" / f"way{i}", steps)
            print(f"  {runs[way]['effective_train_tokens_per_s']:,.0f} tokens/s", flush=True)
        base = runs[OFF]["effective_train_tokens_per_s"]
        repetitions.append(
            {"runs": runs, "over_off": {w: x["effective_train_tokens_per_s"] / base for w, x in runs.items()}}
        )
    over = {w: [rep["over_off"][w] for rep in repetitions] for w in WAYS}
    rows = []
    for w in WAYS:
        tps = [rep["runs"][w]["effective_train_tokens_per_s"] for rep in repetitions]
        rows.append(
            [
                w,
                *(f"{x:,.0f}" for x in tps),
                f"{statistics.fmean(over[w]):.3f}",
                f"{min(over[w]):.3f}-{max(over[w]):.3f}",
                f"{statistics.fmean(rep['runs'][w]['mean_train_s'] for rep in repetitions):.3f}",
                idle_cell(rep["runs"][w] for rep in repetitions),
                f"{statistics.fmean(rep['runs'][w]['lent_share'] for rep in repetitions):.2f}",
            ]
        )
    heads = ["way", *(f"rep {i + 1}" for i in range(reps)), "over off", "range", "training s a step", "idle", "lent"]
    print(format_table(heads, rows))
    if quick:
        print("note: --quick is a smoke check: one short repetition, not a result")
    return {
        "setup": {"model": model, "workload": _WORKLOADS[model], "steps": steps},
        "repetitions": repetitions,
        "summary": {
            "core_lending_on_over_off": statistics.fmean(over[ON]),
            "core_lending_every_moment_over_off": statistics.fmean(over[EVERY]),
            "core_lending_passive_over_off": statistics.fmean(over[PASSIVE]),
        },
    }


if __name__ == "__main__":  # one run, in the fresh process ``_in_fresh_process`` starts
    way_, model_, root_, steps_ = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run_way(way_, model_, root_, steps_)))
