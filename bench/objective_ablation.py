"""AReaL's objective ablation (its Table 2) on the quickstart: naive vs decoupled PPO under staleness.

For each seed: the quickstart synchronous (eta 0, drain), and asynchronous at eta = ETA with
the decoupled objective and with the naive one (PPO clipped around the behaviour policy,
which is what plain PPO does with stale data). Same steps, same everything else. Reported:
held-out accuracy after RL per run, mean ± std per setting over the seeds, the observed
staleness, and the two differences the paper's claim is about (naive - decoupled,
decoupled - sync).

Full: seeds 0-2 (about 50 minutes on 2 cores); --quick: seed 0, 40 steps (shows it runs).
A synchronous run that ``quickstart_seeds`` made (or is making) with the same config
(compared key by key with what this benchmark would run) is reused, not run again.
``python -m bench objective_ablation``; the same grid as a Prefect sweep:
``areal-flow sweep configs/quickstart.yaml --eta 8 --objective decoupled,naive --grid seed=0,1,2``.
"""

from __future__ import annotations

import statistics

import json
import time

import yaml

from bench.common import format_table
from bench.learning import CONFIG, SYNC, mean_std, run_row, runs_root, say, train

ETA = 8
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2), (0,)
QUICK_STEPS = 40
SETTINGS = {
    f"eta{ETA}-decoupled": (f"trainer.eta={ETA}", "trainer.objective=decoupled"),
    f"eta{ETA}-naive": (f"trainer.eta={ETA}", "trainer.objective=naive"),
    "sync": SYNC,
}


def _earlier_sync_run(seed: int) -> dict | None:
    """quickstart_seeds' synchronous run of ``seed`` (waited for while that benchmark is still
    making it), if its config is exactly the one this would run."""
    from areal_core.experiment import load_config

    run_dir = runs_root("quickstart_seeds") / f"sync-seed{seed}"
    if not (run_dir / "config.json").is_file():
        return None
    while not (run_dir / "summary.json").is_file():  # quickstart_seeds is running it now
        time.sleep(30)
    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in SYNC)}
    want = load_config(CONFIG, {"seed": seed, **sets}).model_dump(mode="json")
    if json.loads((run_dir / "config.json").read_text()) != want:
        return None
    say(f"sync-seed{seed}: reusing {run_dir} (quickstart_seeds, same config)")
    return run_row(f"sync-seed{seed}", seed, SYNC, run_dir)


def run(quick: bool) -> dict:
    seeds = SEEDS_QUICK if quick else SEEDS_FULL
    extra = (f"trainer.max_steps={QUICK_STEPS}",) if quick else ()
    root = runs_root("objective_ablation")
    rows = []
    for name, sets in SETTINGS.items():  # sync last: quickstart_seeds may be making those runs
        for seed in seeds:
            row = None if quick or name != "sync" else _earlier_sync_run(seed)
            rows.append({"setting": name, **(row or train(f"{name}-seed{seed}", seed, sets + extra, root))})
    table, summary = [], {}
    for name in SETTINGS:
        mine = [r for r in rows if r["setting"] == name]
        after = [r["after"] for r in mine]
        m, s = mean_std(after)
        summary[f"{name}_after_mean"], summary[f"{name}_after_std"] = m, s
        table.append((name, " ".join(f"{a:.3f}" for a in after), f"{m:.3f} ± {s:.3f}",
                      f"{statistics.fmean(r['gain'] for r in mine):+.3f}",
                      max(r["max_staleness"] for r in mine)))
    print(format_table(["setting", f"after RL, seeds {list(seeds)}", "mean ± std", "mean gain", "max staleness"],
                       table, title=f"objective ablation at eta {ETA}"))
    d, n, sy = (summary[f"eta{ETA}-decoupled_after_mean"], summary[f"eta{ETA}-naive_after_mean"],
                summary["sync_after_mean"])
    summary.update({"naive_minus_decoupled": n - d, "decoupled_minus_sync": d - sy})
    print(f"naive - decoupled: {n - d:+.3f}; decoupled - sync: {d - sy:+.3f} (means over seeds {list(seeds)})")
    return {"eta": ETA, "seeds": list(seeds), "rows": rows, "summary": summary}
