"""How far a run repeats, and what replaying or repeating it exactly costs.

1. Spread: the quickstart as shipped (asynchronous, eta 4), 5 runs with seed 0, against the 5
   seeds of ``bench/results/quickstart_seeds.json``: held-out accuracy after RL, mean and spread.
2. Replay: ``areal-flow replay`` of the first repeat (300 steps) and of a code-quickstart run, with
   every core (the default) and with the original trainer's one thread (``--threads 1``): the final checkpoint's weight
   hash against the original's, and the replay's wall time against the original run's (its training
   loop, and the whole command).
3. Deterministic asynchronous mode: the quickstart for 60 steps, default against
   ``rollout.deterministic`` (+ ``rollout.batch_invariant``), alternating, 3 repetitions: effective
   training tokens/s and their ratio; the deterministic runs' final weight hashes, which must agree.

--quick: 2 repeats of 40 steps, one pair of 20-step runs, no code quickstart: a smoke check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd

from bench.common import REPO_ROOT, RESULTS_DIR, format_table, median, spread
from bench.learning import mean_std, runs_root, say, train

DETERMINISTIC = ("rollout.deterministic=true", "rollout.batch_invariant=true")


def _final_hash(run_dir: Path) -> str:
    m = pd.read_parquet(run_dir / "metrics.parquet")
    return m["weights_sha256"].dropna().iloc[-1]


def replay(run_dir: Path, out: Path, threads: int | None = None) -> dict:
    cmd = [str(REPO_ROOT / ".venv" / "bin" / "areal-flow"), "replay", str(run_dir), "--out", str(out), "--no-prefect"]
    cmd += ["--threads", str(threads)] if threads else []
    shutil.rmtree(out, ignore_errors=True)
    say(" ".join(cmd[1:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    lines = [x for x in proc.stdout.splitlines() if x.startswith("v")]
    return {
        "rc": proc.returncode,
        "lines": lines,
        "final_match": summary["checkpoints"][-1]["match"],
        "all_match": summary["all_match"],
        "checkpoints": len(summary["checkpoints"]),
        "threads": summary["threads"],
        "command_wall_s": wall,
        "replay_s": summary["wall_time_s"],
        "original_rl_s": summary["original_rl_time_s"],
        "original_wall_s": summary["original_wall_time_s"],
        "over_original_rl": wall / summary["original_rl_time_s"],
        "over_original_wall": wall / summary["original_wall_time_s"],
    }


def run(quick: bool) -> dict:
    root = runs_root("repeatability" + ("_quick" if quick else ""))
    n, steps = (2, 40) if quick else (5, None)
    extra = (f"trainer.max_steps={steps}",) if steps else ()
    repeats = [train(f"repeat{i}", 0, extra, root) for i in range(n)]
    seeds_file = RESULTS_DIR / "quickstart_seeds.json"
    seeds = (
        [r for r in json.loads(seeds_file.read_text())["rows"] if r["mode"] == "async"] if seeds_file.exists() else []
    )
    spread_rows = [
        (
            "seed 0, repeated",
            len(repeats),
            *mean_std([r["after"] for r in repeats]),
            min(r["after"] for r in repeats),
            max(r["after"] for r in repeats),
        )
    ]
    if seeds:
        spread_rows.append(
            (
                "seeds 0-4 (quickstart_seeds.json)",
                len(seeds),
                *mean_std([r["after"] for r in seeds]),
                min(r["after"] for r in seeds),
                max(r["after"] for r in seeds),
            )
        )
    print(
        format_table(
            ["runs", "n", "held-out after: mean", "std", "min", "max"],
            spread_rows,
            title="quickstart: held-out accuracy after RL, one seed repeated against several seeds",
        )
    )

    replays = {
        "quickstart": replay(root / "repeat0", root / "replay-repeat0"),
        "quickstart, 1 thread": replay(root / "repeat0", root / "replay-repeat0-1-thread", 1),
    }
    if not quick:
        code = train("code-seed0", 0, (), root, config="configs/code_quickstart.yaml")
        replays["code_quickstart"] = replay(Path(code["run_dir"]), root / "replay-code-seed0")
        replays["code_quickstart, 1 thread"] = replay(Path(code["run_dir"]), root / "replay-code-seed0-1-thread", 1)
    print(
        format_table(
            ["run", "final hash", "replay (s)", "original RL loop (s)", "original command (s)", "replay / RL loop"],
            [
                (
                    k,
                    "match" if r["final_match"] else "DIFFERS",
                    r["command_wall_s"],
                    r["original_rl_s"],
                    r["original_wall_s"],
                    f"{r['over_original_rl']:.2f}",
                )
                for k, r in replays.items()
            ],
            title="areal-flow replay from v0 to the last step",
        )
    )

    reps, short = (1, 20) if quick else (3, 60)
    tps: dict[str, list[float]] = {"default": [], "deterministic": []}
    hashes = []
    for i in range(reps):
        for mode, sets in (("default", ()), ("deterministic", DETERMINISTIC)):
            row = train(f"{mode}-{i}", 0, sets + (f"trainer.max_steps={short}",), root)
            tps[mode].append(row["tokens_per_s"])
            if mode == "deterministic":
                hashes.append(_final_hash(Path(row["run_dir"])))
    ratios = [d / a for a, d in zip(tps["default"], tps["deterministic"])]
    print(
        format_table(
            ["mode", "train tokens/s (median)", "runs"],
            [(m, median(v), len(v)) for m, v in tps.items()],
            title=f"quickstart, {short} steps: deterministic / default = {median(ratios):.3f} "
            f"(per pair {', '.join(f'{r:.3f}' for r in ratios)}); deterministic final hashes "
            f"{'all equal' if len(set(hashes)) == 1 else 'DIFFER'}",
        )
    )
    summary = {
        "repeat_after_std": mean_std([r["after"] for r in repeats])[1],
        "seeds_after_std": mean_std([r["after"] for r in seeds])[1] if seeds else None,
        "replay_final_match": all(r["final_match"] for r in replays.values()),
        "replay_over_original_rl": {k: r["over_original_rl"] for k, r in replays.items()},
        "deterministic_over_default": median(ratios),
        "deterministic_hashes_equal": len(set(hashes)) == 1,
    }
    return {
        "repeats": repeats,
        "seeds": seeds,
        "replays": replays,
        "throughput": tps,
        "ratio_spread": spread(ratios),
        "deterministic_hashes": hashes,
        "summary": summary,
    }
