"""The simulator against this machine, repeated: the validation runs of docs/PLANNING.md,
each made `reps` times, then the calibrated simulator (`areal_core/sim/local.py`) on all of them.

    .venv/bin/python -m bench sim_validation [--quick]

Per repetition: the quickstart asynchronous and synchronous (`areal-flow train`, 100
steps, each in its own process as a user runs it), then the TRL-peer setting's
areal-flow runs (bench/trl_peer.py's two settings, sync and async, 30 steps; TRL itself
is not run), each with its own Dask cluster. Every run starts once the machine is idle (under 10% of
its CPU busy for 3 s in a row). Repetitions of a setting are one row of the table: the
measured mean and its spread, each prediction's error against the mean and, in brackets,
its range over the repetitions. The calibration is the one in the repository
(`areal_core/sim/data/calibration_quickstart.json`); measure it again, the same day, with
`areal-flow calibrate` and `areal-flow calibrate-in-situ measure`.
The runs stay in runs/sim-validation/<time>/. A diagnostic, not part of `bench all`:
--quick makes 1 repetition of shorter runs.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import REPO_ROOT

REPS_FULL, REPS_QUICK = 3, 1
QUICKSTART = (("qs-async", "configs/quickstart.yaml"), ("qs-sync", "configs/quickstart_sync.yaml"))
QS_STEPS_FULL, QS_STEPS_QUICK = 100, 12
TRL_STEPS_QUICK = 10  # of which bench/trl_peer.py's WARMUP (2) are not measured
IDLE_BUSY_SHARE, IDLE_SECONDS, IDLE_TIMEOUT_S = 0.10, 3, 600


def _busy_share(interval: float = 1.0) -> float:
    """Share of all cores busy over `interval` seconds (/proc/stat)."""

    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = read()
    time.sleep(interval)
    t1, i1 = read()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def wait_idle() -> float:
    """Block until the machine is idle (see the module docstring); returns the seconds waited.
    Raises after IDLE_TIMEOUT_S: a timing on a busy machine is not a measurement."""
    t0, quiet = time.monotonic(), 0
    while quiet < IDLE_SECONDS:
        quiet = quiet + 1 if _busy_share() < IDLE_BUSY_SHARE else 0
        if time.monotonic() - t0 > IDLE_TIMEOUT_S:
            raise RuntimeError(
                f"the machine stayed busy for {IDLE_TIMEOUT_S} s (more than "
                f"{IDLE_BUSY_SHARE:.0%} of its CPU): no validation run started"
            )
    return time.monotonic() - t0


def make_runs(root: Path, reps: int, qs_steps: int, trl_steps: int, parts=("quickstart", "trl-peer")) -> list[str]:
    """The validation runs, repetition by repetition; returns their folders. Every run starts
    its own Dask cluster, as `areal-flow train` does (bench/trl_peer.py shares one between
    its runs: on this machine that measured 10-20% slower, see docs/PLANNING.md)."""
    from areal_core.sim.in_situ import train_run
    from bench.trl_peer import SETTINGS, prepare_inputs, run_areal

    inputs = prepare_inputs(root / "trl") if "trl-peer" in parts else None
    dirs: list[str] = []
    for rep in range(reps):
        for name, config in QUICKSTART if "quickstart" in parts else ():
            waited = wait_idle()
            print(f"[rep {rep}] {name} (waited {waited:.0f} s for an idle machine)", flush=True)
            dirs.append(train_run(REPO_ROOT / config, root / f"rep{rep}" / name, qs_steps, quiet=True))
        for P, G, T in SETTINGS if inputs else ():
            for mode in ("sync", "async"):
                run_dir = root / f"rep{rep}" / f"P{P}xG{G}_T{T}" / mode
                waited = wait_idle()
                print(f"[rep {rep}] TRL-peer P{P} x G{G}, T {T}, {mode} (waited {waited:.0f} s)", flush=True)
                run_areal(mode, inputs, P, G, T, trl_steps, run_dir, None)
                dirs.append(str(run_dir))
    return dirs


def run(quick: bool, root: Path | None = None) -> dict:
    from areal_core.sim.local import format_rows, validate_runs
    from areal_core.sim.measure import DEFAULT_CALIBRATION, load_calibration
    from bench.trl_peer import STEPS_FULL

    reps = REPS_QUICK if quick else REPS_FULL
    qs_steps, trl_steps = (QS_STEPS_QUICK, TRL_STEPS_QUICK) if quick else (QS_STEPS_FULL, STEPS_FULL)
    root = root or REPO_ROOT / "runs" / "sim-validation" / time.strftime("%Y%m%dT%H%M%S")
    dirs = make_runs(root, reps, qs_steps, trl_steps)
    cost, data = load_calibration(REPO_ROOT / DEFAULT_CALIBRATION)
    rows = validate_runs(dirs, cost, seeds=3, in_situ=data.get("in_situ"))
    print(format_rows(rows), flush=True)
    worst = max(abs(r["in_situ_rel_error"]) for r in rows) if data.get("in_situ") else None
    return {
        "setup": {
            "repetitions": reps,
            "quickstart_steps": qs_steps,
            "trl_peer_steps": trl_steps,
            "calibration": DEFAULT_CALIBRATION,
            "calibration_measured": data.get("measured_at"),
            "run_root": str(root),
        },
        "rows": rows,
        "summary": {"sim_validation_worst_in_situ_error": worst},
    }
