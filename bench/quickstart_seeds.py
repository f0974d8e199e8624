"""The quickstart's RL gain on several seeds, asynchronous and synchronous.

For each seed S: ``areal-flow train configs/quickstart.yaml --set seed=S`` (asynchronous,
the quickstart as shipped) and the same with ``--set trainer.eta=0 --set
rollout.weight_update=drain`` (synchronous). The seed sets the model's initialisation,
the warm start's draws, the prompt order and the sampling; the task and the held-out
set stay the same. Reported per run: held-out greedy accuracy before and after RL (500
problems, strict grading), the gain, the command's wall time (warm start included:
the warm-start cache is cleared first unless --quick) and the effective training
tokens/s; then mean ± std over the seeds.

Full: seeds 0-4, both modes (about an hour on 2 cores). --quick: seeds 0-1,
asynchronous only, 40 RL steps: it shows the pipeline runs, not the gain.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from bench.common import format_table
from bench.learning import SYNC, mean_std, pm, runs_root, train

SEEDS_FULL, SEEDS_QUICK = (0, 1, 2, 3, 4), (0, 1)
QUICK_STEPS = 40


def run(quick: bool) -> dict:
    seeds = SEEDS_QUICK if quick else SEEDS_FULL
    modes = {"async": ()} if quick else {"async": (), "sync": SYNC}
    extra = (f"trainer.max_steps={QUICK_STEPS}",) if quick else ()
    root = runs_root("quickstart_seeds")
    cache = None
    if not quick:  # every warm start trains inside the measured wall time, as on a fresh machine
        cache = tempfile.mkdtemp(prefix="areal-flow-cache-")
        os.environ["AREAL_FLOW_CACHE"] = cache
    rows = []
    try:
        for seed in seeds:
            for mode, sets in modes.items():
                row = train(f"{mode}-seed{seed}", seed, sets + extra, root)
                rows.append({"mode": mode, **row})
    finally:
        if cache:
            os.environ.pop("AREAL_FLOW_CACHE", None)
            shutil.rmtree(cache, ignore_errors=True)
    print(
        format_table(
            ["mode", "seed", "before", "after", "gain", "wall (s)", "RL (s)", "train tok/s", "warm-start steps"],
            [
                (
                    r["mode"],
                    r["seed"],
                    r["before"],
                    r["after"],
                    f"{r['gain']:+.3f}",
                    r["command_wall_s"],
                    r["rl_time_s"],
                    r["tokens_per_s"],
                    r.get("warm_start_steps", ""),
                )
                for r in rows
            ],
            title="quickstart: held-out accuracy before -> after RL, per seed",
        )
    )
    summary = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        gains = [r["gain"] for r in mine]
        m, s = mean_std(gains)
        summary.update(
            {
                f"{mode}_gain_mean": m,
                f"{mode}_gain_std": s,
                f"{mode}_gain_min": min(gains),
                f"{mode}_wall_max_s": max(r["command_wall_s"] for r in mine),
                f"{mode}_tokens_per_s_mean": mean_std([r["tokens_per_s"] for r in mine])[0],
            }
        )
        print(
            f"{mode}: gain {pm(gains)} over seeds {list(seeds)} (min {min(gains):+.3f}); "
            f"wall time max {summary[f'{mode}_wall_max_s']:.0f}s"
        )
    return {"seeds": list(seeds), "rows": rows, "summary": summary}
