"""AReaL's objective ablation (its Table 2) on the quickstart: naive vs decoupled PPO under staleness.

For each seed: the quickstart synchronous (eta 0, drain), and asynchronous at each eta of
ETAS with the decoupled objective and with the naive one (PPO clipped around the behaviour policy,
which is what plain PPO does with stale data). Same steps, same everything else. Reported:
held-out accuracy after RL per run, mean ± std per setting over the seeds, the observed
staleness, and the two differences the paper's claim is about (naive - decoupled,
decoupled - sync); the same at each eta with 4 PPO minibatches per step (sync likewise).

Full: seeds 0-2 (about 4 minutes a run on 2 cores); --quick: seed 0, 40 steps (shows it
runs). A finished run with exactly the config this would run (compared key by key) is
reused, not run again: this benchmark's own earlier runs, and the synchronous runs that
``quickstart_seeds`` made (or is making).
``python -m bench objective_ablation``; the same grid as a Prefect sweep:
``areal-flow sweep configs/quickstart.yaml --eta 8,32 --objective decoupled,naive --grid seed=0,1,2``.

``--model smollm2``: the same question on SmolLM2-135M-Instruct (bench/ablation_smollm2.py).
"""

from __future__ import annotations

import json
import time

from bench.learning import CONFIG, SYNC, accuracy_table, expected_config, run_row, runs_root, say, train

ETAS = (8, 32)
CAP = 5
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2), (0,)
QUICK_STEPS = 40
TIGHT_CLIP, TIGHT_CLIP_TAG = 0.05, "05"
SETTINGS = {
    **{
        f"eta{eta}-{objective}": (f"trainer.eta={eta}", f"trainer.objective={objective}")
        for eta in ETAS
        for objective in ("decoupled", "naive")
    },
    # AReaL drops tokens whose behaviour weight pi_prox / pi_behav passes a cap (its configs use 5)
    f"eta{ETAS[-1]}-decoupled-cap{CAP}": (
        f"trainer.eta={ETAS[-1]}",
        "trainer.objective=decoupled",
        "trainer.off_policy.kind=cap",
        f"trainer.off_policy.cap={CAP}",
    ),
    "sync": SYNC,
    # 4 PPO minibatches per step (so pi_prox differs from the policy being updated, and the policy
    # moves 4 optimizer steps per version): naive, decoupled with the cap, and sync, at the same setting
    **{
        f"eta{eta}-naive-mb4": (f"trainer.eta={eta}", "trainer.objective=naive", "trainer.ppo_minibatches=4")
        for eta in ETAS
    },
    **{
        f"eta{eta}-decoupled-cap{CAP}-mb4": (
            f"trainer.eta={eta}",
            "trainer.objective=decoupled",
            "trainer.off_policy.kind=cap",
            f"trainer.off_policy.cap={CAP}",
            "trainer.ppo_minibatches=4",
        )
        for eta in ETAS
    },
    "sync-mb4": SYNC + ("trainer.ppo_minibatches=4",),
    # naive PPO with a tight trust region (docs/RL_TUNING.md 7.3, fifth setting): at the default eps 0.2 the clip around the
    # behaviour policy rarely binds on this model (0.6-0.9 % of tokens at eta 8); at 0.05 it does. With one
    # PPO minibatch, eps cannot change sync or decoupled runs (their ratio pi / pi_prox is exactly 1 at
    # the only update), so "sync" and "eta8-decoupled" are their baselines
    f"eta8-naive-clip{TIGHT_CLIP_TAG}": ("trainer.eta=8", "trainer.objective=naive", f"trainer.eps_clip={TIGHT_CLIP}"),
}
TIGHT = ("sync", "eta8-decoupled", f"eta8-naive-clip{TIGHT_CLIP_TAG}")


def _finished_run(run_dir, seed: int, sets: tuple[str, ...], wait: bool = False) -> dict | None:
    """The figures of the run in ``run_dir`` if it is exactly the one this would run (its
    config compared key by key): an earlier run of this benchmark, or quickstart_seeds'
    synchronous run of the seed (``wait``: quickstart_seeds may be making it now)."""
    if not (run_dir / "config.json").is_file():
        return None
    while wait and not (run_dir / "summary.json").is_file():
        time.sleep(30)
    if not (run_dir / "summary.json").is_file():
        return None  # an earlier run that did not finish: run it again
    if json.loads((run_dir / "config.json").read_text()) != expected_config(CONFIG, seed, sets):
        return None
    say(f"{run_dir.name}: reusing {run_dir} (same config)")
    return run_row(run_dir.name, seed, sets, run_dir)


def run_settings(names=TIGHT, seeds=SEEDS_FULL) -> dict:
    """Only the settings ``names`` (default: the tight-clip comparison) on ``seeds``, runs reused
    as ``run`` reuses them; prints each setting's mean and the naive - decoupled and
    decoupled - sync differences where the three are there. ``python -c "from
    bench.objective_ablation import run_settings; run_settings()"``"""
    root = runs_root("objective_ablation")
    rows = []
    for seed in seeds:  # seed by seed, so that a stopped run leaves whole comparisons
        for name in names:
            label = f"{name}-seed{seed}"
            row = _finished_run(root / label, seed, SETTINGS[name])
            rows.append({"setting": name, **(row or train(label, seed, SETTINGS[name], root))})
    means = {
        name: m for name, (m, _) in accuracy_table(rows, names, seeds, "objective ablation, selected settings").items()
    }
    naive = [n for n in names if "naive" in n]
    if "sync" in means and "eta8-decoupled" in means:
        print(f"eta 8: decoupled - sync {means['eta8-decoupled'] - means['sync']:+.3f}")
        for n in naive:
            print(f"eta 8: {n} - decoupled {means[n] - means['eta8-decoupled']:+.3f}")
    return {"seeds": list(seeds), "rows": rows, "means": means}


def run(quick: bool, model: str = "tiny") -> dict:
    if model == "smollm2":
        from bench.ablation_smollm2 import run_smollm2

        return run_smollm2(quick)
    seeds = SEEDS_QUICK if quick else SEEDS_FULL
    extra = (f"trainer.max_steps={QUICK_STEPS}",) if quick else ()
    root = runs_root("objective_ablation")
    rows = []
    for name, sets in SETTINGS.items():  # sync last: quickstart_seeds may be making those runs
        for seed in seeds:
            label = f"{name}-seed{seed}"
            row = _finished_run(root / label, seed, sets + extra)
            if row is None and name == "sync" and not quick:
                row = _finished_run(runs_root("quickstart_seeds") / label, seed, sets, wait=True)
            rows.append({"setting": name, **(row or train(label, seed, sets + extra, root))})
    summary = {}
    for name, (m, s) in accuracy_table(
        rows, SETTINGS, seeds, "objective ablation (held-out accuracy after 300 RL steps)"
    ).items():
        summary[f"{name}_after_mean"], summary[f"{name}_after_std"] = m, s
    for eta in ETAS:
        d, n, sy = (
            summary[f"eta{eta}-decoupled_after_mean"],
            summary[f"eta{eta}-naive_after_mean"],
            summary["sync_after_mean"],
        )
        summary.update({f"eta{eta}_naive_minus_decoupled": n - d, f"eta{eta}_decoupled_minus_sync": d - sy})
        print(
            f"eta {eta}: naive - decoupled {n - d:+.3f}; decoupled - sync {d - sy:+.3f} "
            f"(means over seeds {list(seeds)})"
        )
    capped, n = summary[f"eta{ETAS[-1]}-decoupled-cap{CAP}_after_mean"], summary[f"eta{ETAS[-1]}-naive_after_mean"]
    summary.update({"capped_minus_naive": capped - n, "capped_minus_sync": capped - summary["sync_after_mean"]})
    print(
        f"eta {ETAS[-1]}, decoupled with behaviour weights capped at {CAP}: naive - capped {n - capped:+.3f}; "
        f"capped - sync {capped - summary['sync_after_mean']:+.3f}"
    )
    for e in ETAS:
        n4, d4, s4 = (
            summary[f"eta{e}-naive-mb4_after_mean"],
            summary[f"eta{e}-decoupled-cap{CAP}-mb4_after_mean"],
            summary["sync-mb4_after_mean"],
        )
        summary.update({f"eta{e}_mb4_naive_minus_decoupled": n4 - d4, f"eta{e}_mb4_decoupled_minus_sync": d4 - s4})
        print(
            f"eta {e}, 4 PPO minibatches: naive - decoupled (cap {CAP}) {n4 - d4:+.3f}; decoupled - sync {d4 - s4:+.3f}"
        )
    return {"etas": list(ETAS), "seeds": list(seeds), "rows": rows, "summary": summary}
