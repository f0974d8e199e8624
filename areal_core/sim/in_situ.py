"""What the whole system adds to its components' costs on a machine whose processes share
the cores, measured in situ from short runs in calibration settings.

    areal-flow calibrate-in-situ measure [--config C] [--set K=V ...] [--steps N]
    areal-flow calibrate-in-situ fit RUN_DIR [RUN_DIR ...]

On a GPU cluster every rollout server and the trainer own their devices, and the
component costs `areal-flow calibrate` measures alone (`measure.py`) are what they cost in a run. On a
2-core CPU they are not: the trainer shares the cores with the rollout server, the Dask
worker and scheduler and the controller's threads, and a synchronous step waits for
HTTP calls and the grading of its last groups. From runs of the whole system (made by
`measure`, in a setting that is none of the validation rows) this module takes, per mode:

* training: the training step's time in the run (`step_time_s - wait_time_s -
  publish_time_s - checkpoint_time_s`) against its cost measured alone, each step costed with its own batch
  from the ledger, fitted over every step after warm-up as `in_run = train_slowdown x
  alone + train_fixed_s`;
* `step_overhead_s`: the trainer's time per step outside the training step (staging and
  publishing the weights, metrics, checkpoints): the mean `publish_time_s +
  checkpoint_time_s`;
* generation (synchronous runs): a step's generation phase (`wait_time_s`: weights
  loaded, answers generated over HTTP, graded) against the same phase simulated with the
  component costs and the run's answer lengths, fitted over the runs as `in_run =
  generation_slowdown x simulated + generation_fixed_s` (one synchronous run, or a fit
  whose fixed part would be negative: the slope through the origin alone). An asynchronous run never waits on generation, so it cannot measure this; it
  takes the synchronous slowdown, and not the fixed part, which is latency (HTTP round
  trips, the last group's grading, confirming the weights) that a synchronous step waits
  out and an asynchronous one overlaps.

Two calibration settings of different batch sizes (the default) give both parts of each
fit their leverage.

`areal_core.sim.cost.in_situ_cost(cost, fit, mode)` scales the component cost model by
them; the simulator itself is unchanged. `fit` writes them into the calibration file under
"in_situ", with the runs they came from.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from areal_core.sim.cost import CostModel

# The calibration settings: the quickstart's model and task with 4 and 24 prompts of 8 answers a
# step (the quickstart has 16) and another seed, so that no validation row (docs/PLANNING.md) is
# its own calibration; a small held-out evaluation (it runs outside the measured time)
DEFAULT_BATCHES = (32, 192)
DEFAULT_SETS = ("seed=1", "eval.n_problems=64")
DEFAULT_STEPS = 60
SYNC_SETS = ("trainer.eta=0", "rollout.weight_update=drain")


def _step_batches(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Step -> (tokens the trainer computes, sum of squared sequence lengths), each group's
    prompt computed once, as `SimConfig.train_shared_prompt` costs it."""
    import pandas as pd

    from areal_core.experiment import parse_config
    from areal_core.sim.local import _prompt_lengths

    cfg = parse_config(json.loads((run_dir / "config.json").read_text()), source=str(run_dir / "config.json"))
    prompt_len = _prompt_lengths(cfg)
    ledger = pd.read_parquet(run_dir / "ledger.parquet")
    parts = ledger["trajectory_id"].str.extract(r"^(e\d+-p(.+))-s\d+$")
    ledger = ledger.assign(group=parts[0], prompt=parts[1].map(prompt_len))
    if ledger["prompt"].isna().any():
        raise ValueError(f"{run_dir}/ledger.parquet: trajectory ids whose prompt is not in the run's data set")
    out = {}
    for step, rows in ledger.groupby("step"):
        seq = rows["prompt"].to_numpy(float) + rows["n_tokens"].to_numpy(float)
        prompts_once = rows.drop_duplicates("group")["prompt"].sum()
        out[int(step)] = (float(rows["n_tokens"].sum() + prompts_once), float((seq**2).sum()))
    return out


def measure_run(run_dir: str | Path, cost: CostModel, seeds: int = 3) -> dict:
    """The in-situ ratios of one finished run (see the module docstring)."""
    import pandas as pd

    from areal_core.sim.engine import resolve, simulate
    from areal_core.sim.local import read_run, sim_config

    run = Path(run_dir)
    facts = read_run(run)
    metrics = pd.read_parquet(run / "metrics.parquet").sort_values("step")
    batches = _step_batches(run)
    setup = resolve(sim_config(facts, cost))
    after = metrics[metrics["step"] > facts.warmup_steps]
    if after.empty:
        raise ValueError(f"{run}: no step after the {facts.warmup_steps} warm-up steps")
    checkpoint = after.get("checkpoint_time_s", 0.0)  # older runs: inside publish_time_s
    in_run = (after["step_time_s"] - after["wait_time_s"] - after["publish_time_s"] - checkpoint).to_numpy()
    alone = np.array([cost.train_s(batches[s][0], batches[s][1], setup.n_trainer_gpus) for s in after["step"]])
    out = {
        "run_dir": str(run),
        "name": facts.name,
        "mode": facts.mode,
        "steps_used": len(after),
        "batch": facts.prompts_per_step * facts.answers_per_prompt,
        "train_points": [[float(a), float(b)] for a, b in zip(alone, in_run)],
        "train_slowdown": float(in_run.sum() / alone.sum()),
        "step_overhead_s": float((after["publish_time_s"] + checkpoint).mean()),
        "train_s_in_run": float(in_run.mean()),
        "train_s_alone": float(alone.mean()),
        "measured_tokens_per_s": facts.measured_tokens_per_s,
    }
    if facts.mode == "sync":
        simulated = []
        for seed in range(seeds):
            r = simulate(sim_config(facts, cost, seed))
            steps = np.diff(np.concatenate([[0.0], r.step_end_s]))
            simulated.append(float((steps - r.step_train_s)[facts.warmup_steps :].mean()))
        out["generation_s_in_run"] = float(after["wait_time_s"].mean())
        out["generation_s_simulated"] = float(np.mean(simulated))
        out["generation_slowdown"] = out["generation_s_in_run"] / out["generation_s_simulated"]
    return out


def _line(x, y, intercept_min: float | None = None) -> tuple[float, float]:
    """Least-squares slope and intercept of y on x. Through the origin when x has no spread,
    or when the intercept would fall below `intercept_min` (a time that cannot be negative)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size >= 2 and np.ptp(x) > 1e-9 * max(abs(x).max(), 1e-12):
        slope, intercept = np.polyfit(x, y, 1)
        if intercept_min is None or intercept >= intercept_min:
            return float(slope), float(intercept)
    return float((x * y).sum() / (x * x).sum()), 0.0


def fit(run_dirs: list[str], cost: CostModel, seeds: int = 3) -> dict:
    """Per mode, the fits of the module docstring over the given runs; needs at least one
    synchronous run (the only kind that measures generation)."""
    runs = [measure_run(d, cost, seeds) for d in run_dirs]
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "async")}
    if not by_mode["sync"]:
        raise ValueError(
            "in-situ fit: no synchronous run among "
            + ", ".join(run_dirs)
            + " (eta 0 and weight_update drain): the generation fit needs one"
        )
    sync = by_mode["sync"]
    g, a = _line(
        [r["generation_s_simulated"] for r in sync], [r["generation_s_in_run"] for r in sync], intercept_min=0.0
    )
    modes = {}
    for mode, rs in by_mode.items():
        if not rs:
            continue
        points = np.array([p for r in rs for p in r["train_points"]])
        k, c = _line(points[:, 0], points[:, 1])
        modes[mode] = {
            "train_slowdown": k,
            "train_fixed_s": c,
            "step_overhead_s": float(np.mean([r["step_overhead_s"] for r in rs])),
            "generation_slowdown": g,
            "generation_fixed_s": a if mode == "sync" else 0.0,
        }
    return {"modes": modes, "runs": runs}


def write_fit(calibration: str | Path, result: dict) -> None:
    """Add (or replace) the "in_situ" section of a calibration file, atomically."""
    from areal_core.storage.fsutil import write_text_atomic

    path = Path(calibration)
    data = json.loads(path.read_text())
    data["in_situ"] = result
    write_text_atomic(str(path), json.dumps(data, indent=1) + "\n")


def _areal_flow() -> str:
    """The `areal-flow` command of this environment."""
    here = Path(sys.executable).with_name("areal-flow")
    found = str(here) if here.is_file() else shutil.which("areal-flow")
    if not found:
        raise RuntimeError("areal-flow is not installed in this environment (make setup)")
    return found


def train_run(config: str, run_dir: Path, steps: int, sets=(), quiet: bool = False) -> str:
    """One `areal-flow train` run in its own process, as a user runs it (`quiet`: its
    output discarded); returns its folder."""
    cmd = [
        _areal_flow(),
        "train",
        str(config),
        "--no-prefect",
        "--no-progress",
        "--max-steps",
        str(steps),
        "--run-dir",
        str(run_dir),
    ]
    for s in sets:
        cmd += ["--set", s]
    if not quiet:
        print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
    return str(run_dir)


def run_calibration(config: str, sets: list[str], batches: list[int], steps: int, out_dir: Path) -> list[str]:
    """The calibration runs, per batch size synchronous then asynchronous (`train_run`).
    Returns their folders."""
    return [
        train_run(config, out_dir / f"b{batch}" / mode, steps, (*sets, f"trainer.batch_size={batch}", *extra))
        for batch in batches
        for mode, extra in (("sync", SYNC_SETS), ("async", ()))
    ]


def format_fit(result: dict) -> str:
    lines = [
        (
            "| run | mode | answers a step | training step in run / alone (mean) | ratio | publish per step "
            "| generation in run / simulated (mean) | ratio |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        gen = (
            f"{r['generation_s_in_run']:.3f} s / {r['generation_s_simulated']:.3f} s | {r['generation_slowdown']:.2f}"
            if "generation_slowdown" in r
            else "- | -"
        )
        lines.append(
            f"| {r['run_dir']} | {r['mode']} | {r['batch']} | {r['train_s_in_run']:.3f} s / "
            f"{r['train_s_alone']:.3f} s | {r['train_slowdown']:.2f} | {r['step_overhead_s'] * 1e3:.1f} ms | {gen} |"
        )
    for mode, v in result["modes"].items():
        lines.append(
            f"\n{mode}: training {v['train_slowdown']:.2f} x alone {v['train_fixed_s'] * 1e3:+.1f} ms, "
            f"+{v['step_overhead_s'] * 1e3:.1f} ms per step outside it; generation "
            f"{v['generation_slowdown']:.2f} x simulated + {v['generation_fixed_s'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)
