"""How long an exact replay takes against the run it replays.

For seeds 0 and 1: the quickstart as shipped (300 steps, asynchronous, eta 4), then
``areal-flow replay`` of it from v0 to the last step, on every core (the default) and on the
original trainer's one thread (``--threads 1``), the two in turn (which goes first alternates by
seed). For each: whether every checkpoint's weight hash matches the original's, and the replay's
wall time against the original's, command against command (both include Python's start-up and
imports) and inside against inside (the replay's own ``wall_time_s`` against the run's).

--quick: one seed, 40 steps: a smoke check.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import format_table, median, spread
from bench.learning import runs_root, say, train
from bench.repeatability import replay


def run(quick: bool) -> dict:
    root = runs_root("replay_speed" + ("_quick" if quick else ""))
    seeds, sets = ((0,), ("trainer.max_steps=40",)) if quick else ((0, 1), ())
    rows, out = [], []
    for seed in seeds:
        orig = train(f"original-s{seed}", seed, sets, root)
        arms = [("all cores", None), ("1 thread", 1)]
        for name, threads in arms if seed % 2 == 0 else arms[::-1]:
            r = replay(Path(orig["run_dir"]), root / f"replay-s{seed}-{threads or 'all'}", threads)
            r.update(
                seed=seed,
                arm=name,
                original_command_s=orig["command_wall_s"],
                original_run_s=orig["run_wall_s"],
                over_command=r["command_wall_s"] / orig["command_wall_s"],
                over_inside=r["replay_s"] / orig["run_wall_s"],
            )
            out.append(r)
            rows.append(
                (
                    seed,
                    name,
                    r["threads"],
                    "all match" if r["all_match"] else "DIFFERS",
                    r["checkpoints"],
                    r["command_wall_s"],
                    orig["command_wall_s"],
                    f"{r['over_command']:.3f}",
                    f"{r['over_inside']:.3f}",
                )
            )
    print(
        format_table(
            [
                "seed",
                "replay",
                "threads",
                "hashes",
                "checkpoints",
                "replay command (s)",
                "original command (s)",
                "replay / original (commands)",
                "replay / original (inside)",
            ],
            rows,
            title="areal-flow replay of the quickstart, v0 to the last step",
        )
    )
    by_arm = {arm: [r for r in out if r["arm"] == arm] for arm in ("all cores", "1 thread")}
    summary = {
        arm: {
            "over_command": spread([r["over_command"] for r in rs]),
            "over_inside": spread([r["over_inside"] for r in rs]),
            "all_match": all(r["all_match"] for r in rs),
        }
        for arm, rs in by_arm.items()
    }
    say(
        "replay / original command, median: "
        + ", ".join(f"{arm} {median([r['over_command'] for r in rs]):.3f}" for arm, rs in by_arm.items())
    )
    return {"rows": out, "summary": summary}
