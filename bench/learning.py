"""Shared pieces of the learning benchmarks: one `areal-flow train` per (setting, seed), tabulated.

Learning results are measured over several seeds and reported as mean and standard
deviation, never from one run. Each run is the product's own command,
``areal-flow train CONFIG --set seed=S --set ...``, in a subprocess; its summary.json
is what the tables show. Runs go one after another: each uses the whole machine.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import REPO_ROOT, RUNS_DIR, format_table

CONFIG = "configs/quickstart.yaml"
SYNC = ("trainer.eta=0", "rollout.weight_update=drain")  # the synchronous baseline of any config


def say(text: str) -> None:
    print(text, flush=True)


def runs_root(name: str) -> Path:
    return RUNS_DIR / name


def train(
    label: str, seed: int, sets: tuple[str, ...], root: Path, config: str = CONFIG, resume_stopped: bool = False
) -> dict:
    """One fresh ``areal-flow train`` run (an earlier run in its folder is removed first: callers that
    reuse finished runs decide so before calling); its summary plus the wall time around the command.
    ``resume_stopped``: a run that stopped after a checkpoint (the benchmark was stopped) is continued
    with ``--resume`` instead, as a user would (nothing lost or repeated; the wall time is then that of
    the rest); where that fails it starts afresh."""
    run_dir = root / label
    resume = resume_stopped and _stopped_after_a_checkpoint(run_dir)
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        str(REPO_ROOT / ".venv" / "bin" / "areal-flow"),
        "train",
        config,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--set",
        f"seed={seed}",
    ]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    root.mkdir(parents=True, exist_ok=True)
    say(f"{label}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(root / f"{label}.log", "ab" if resume else "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0 and resume:
        say(f"{label}: resuming failed (rc {rc}; {root / (label + '.log')}); starting it afresh")
        return train(label, seed, sets, root, config)
    if rc != 0:
        raise RuntimeError(f"{label} exited with {rc}; see {root / (label + '.log')}")
    row = run_row(label, seed, sets, run_dir, wall)
    say(f"{label}: {row['before']:.3f} -> {row['after']:.3f} ({row['gain']:+.3f}) in {wall:.0f}s")
    return row


def _stopped_after_a_checkpoint(run_dir: Path) -> bool:
    """A run folder without a summary whose run published a complete checkpoint past v0 (as the
    checkpoint store, which ``--resume`` reads, counts them)."""
    from areal_core.storage import CheckpointStore

    if (run_dir / "summary.json").is_file() or not (run_dir / "checkpoints").is_dir():
        return False
    return (CheckpointStore(str(run_dir / "checkpoints")).latest() or 0) > 0


def run_row(label: str, seed: int, sets: tuple[str, ...], run_dir: Path, wall: float | None = None) -> dict:
    """A finished run's figures, from its summary.json and config.json (``wall``: the
    command's wall time, else the run's own)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    ws = json.loads((run_dir / "config.json").read_text())["model"]["warm_start"]
    return {
        "label": label,
        "seed": seed,
        "sets": list(sets),
        "run_dir": str(run_dir),
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "gain": summary["accuracy_after"] - summary["accuracy_before"],
        "command_wall_s": wall if wall is not None else summary["wall_time_s"],
        "run_wall_s": summary["wall_time_s"],
        "rl_time_s": summary["rl_time_s"],
        "tokens_per_s": summary["effective_train_tokens_per_s"],
        "max_staleness": summary["max_staleness_observed"],
        "warm_start": ws,
        "warm_start_steps": (summary.get("warm_start") or {}).get("steps"),
        "warm_start_val_accuracy": (summary.get("warm_start") or {}).get("val_accuracy"),
    }


def expected_config(config: str, seed: int, sets: tuple[str, ...]) -> dict:
    """The config (as a run's config.json holds it) that ``areal-flow train CONFIG --set seed=SEED
    --set ...`` runs with: what a reused run or record is compared with."""
    from areal_core.experiment import load_config, parse_overrides

    return load_config(config, {"seed": seed, **parse_overrides(list(sets))}).model_dump(mode="json")


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def pm(xs: list[float], digits: int = 3) -> str:
    m, s = mean_std(xs)
    return f"{m:+.{digits}f} ± {s:.{digits}f}" if digits else f"{m:.0f} ± {s:.0f}"


def accuracy_table(rows: list[dict], names, seeds, title: str) -> dict[str, tuple[float, float]]:
    """Print one line per setting of ``names`` (its runs' accuracy after RL, mean ± std, mean gain,
    max staleness); returns setting -> (mean, std) of the accuracy after RL."""
    stats, table = {}, []
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        after = [r["after"] for r in mine]
        stats[name] = m, s = mean_std(after)
        by_seed = {r["seed"]: r["after"] for r in mine}  # "-": that seed's run has not finished
        table.append(
            (
                name,
                " ".join(f"{by_seed[seed]:.3f}" if seed in by_seed else "  -  " for seed in seeds),
                f"{m:.3f} ± {s:.3f}" if len(after) > 1 else f"{m:.3f} (1 run)",
                f"{statistics.fmean(r['gain'] for r in mine):+.3f}",
                max(r["max_staleness"] for r in mine),
            )
        )
    print(
        format_table(
            ["setting", f"after RL, seeds {list(seeds)}", "mean ± std", "mean gain", "max staleness"],
            table,
            title=title,
        )
    )
    return stats
