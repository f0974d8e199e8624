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

``--model smollm2``: the same question on SmolLM2-135M-Instruct and its arithmetic task
(``configs/smollm2_quickstart.yaml``, equal steps, the trainer in float32): sync; eta 8 naive; eta 8
decoupled; eta 8 decoupled with each correction of SMOLLM2_CORRECTIONS (``trainer.off_policy``);
eta 8 decoupled with the rollout servers in bfloat16 (``rollout.dtype``); seeds 0-1 (30 to 50
minutes a run on 2 cores, more for bf16 servers on a CPU without bf16 units, so about 8 hours;
finished runs are reused, and a run the benchmark's stop interrupted resumes from its last checkpoint
with ``--resume``). Held-out accuracy with
spread, and the batch accuracy per step of every setting in one plot
(``bench/results/objective_ablation_smollm2.png``).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time

from bench.common import format_table
from bench.learning import CONFIG, SYNC, mean_std, run_row, runs_root, say, train

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
    from areal_core.experiment import load_config, parse_overrides

    if not (run_dir / "config.json").is_file():
        return None
    while wait and not (run_dir / "summary.json").is_file():
        time.sleep(30)
    if not (run_dir / "summary.json").is_file():
        return None  # an earlier run that did not finish: run it again
    want = load_config(CONFIG, {"seed": seed, **parse_overrides(list(sets))})  # as `--set` reads them
    if json.loads((run_dir / "config.json").read_text()) != want.model_dump(mode="json"):
        return None
    say(f"{run_dir.name}: reusing {run_dir} (same config)")
    return run_row(run_dir.name, seed, sets, run_dir)


def _table(rows: list[dict], names, seeds, title: str) -> dict[str, tuple[float, float]]:
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
    means = {name: m for name, (m, _) in _table(rows, names, seeds, "objective ablation, selected settings").items()}
    naive = [n for n in names if "naive" in n]
    if "sync" in means and "eta8-decoupled" in means:
        print(f"eta 8: decoupled - sync {means['eta8-decoupled'] - means['sync']:+.3f}")
        for n in naive:
            print(f"eta 8: {n} - decoupled {means[n] - means['eta8-decoupled']:+.3f}")
    return {"seeds": list(seeds), "rows": rows, "means": means}


SMOLLM2_CONFIG = "configs/smollm2_quickstart.yaml"
SMOLLM2_CORRECTIONS = ("icepop", "tis")
# every setting trains in float32, so the last one differs from eta8-decoupled in the servers' dtype
# (and their request timeout): bfloat16 servers beside the float32 trainer (the engine-vs-trainer
# mismatch of large deployments; its logprob_gap_mean is in the runs' metrics)
SMOLLM2_FP32 = ("model.dtype=float32",)
SMOLLM2_SETTINGS = {
    name: sets + SMOLLM2_FP32
    for name, sets in {
        "sync": SYNC,
        "eta8-naive": ("trainer.eta=8", "trainer.objective=naive"),
        "eta8-decoupled": ("trainer.eta=8", "trainer.objective=decoupled"),
        **{
            f"eta8-decoupled-{k}": ("trainer.eta=8", "trainer.objective=decoupled", f"trainer.off_policy.kind={k}")
            for k in SMOLLM2_CORRECTIONS
        },
        # emulated bfloat16 (a CPU without bf16 units) answers the 400 held-out problems in more than
        # the default request timeout of 600 s
        "eta8-decoupled-bf16-servers": (
            "trainer.eta=8",
            "trainer.objective=decoupled",
            "rollout.dtype=bfloat16",
            "rollout.request_timeout_s=3600",
        ),
    }.items()
}


SMOLLM2_CORE = ("sync", "eta8-naive", "eta8-decoupled")
# a SmolLM2 checkpoint with its resume state is 1.6 GB: a run keeps its newest one only (what --resume
# reads; the benchmark reads summary.json and the metrics), not the config's two
SMOLLM2_DISK = ("storage.keep_last=1",)


def run_smollm2(quick: bool, train_missing: bool = True) -> dict:
    """The ablation on SmolLM2-135M (see the module docstring); --quick: seed 0, 3 steps of each setting.
    ``train_missing=False``: the table of the runs finished so far, training nothing (the benchmark
    takes hours; ``python -c "from bench.objective_ablation import run_smollm2; run_smollm2(False, False)"``)."""
    from bench.common import RESULTS_DIR
    from bench.smollm2_seeds import QUICK_SETS

    seeds = (0,) if quick else (0, 1)
    root = runs_root("objective_ablation_smollm2" + ("_quick" if quick else ""))
    extra = QUICK_SETS if quick else ()
    rows = []
    # the central comparison (sync, naive, decoupled) on every seed first, then the corrections and
    # the bf16 servers: a stopped benchmark leaves whole comparisons, the most telling first
    core = [n for n in SMOLLM2_SETTINGS if n in SMOLLM2_CORE]
    rest = [n for n in SMOLLM2_SETTINGS if n not in SMOLLM2_CORE]
    for names in (core, rest):
        for seed, name in itertools.product(seeds, names):
            sets = SMOLLM2_SETTINGS[name]
            label = f"{name}-seed{seed}"
            if (root / label / "summary.json").is_file() and not quick:
                row = run_row(label, seed, sets + extra, root / label)
            elif train_missing:
                row = train(
                    label, seed, sets + extra + SMOLLM2_DISK, root, config=SMOLLM2_CONFIG, resume_stopped=not quick
                )
            else:
                continue
            rows.append({"setting": name, **row, **_offpolicy_stats(root / label)})
    rows.sort(key=lambda r: (list(SMOLLM2_SETTINGS).index(r["setting"]), r["seed"]))
    names = [n for n in SMOLLM2_SETTINGS if any(r["setting"] == n for r in rows)]
    title = "SmolLM2-135M: objective ablation (held-out accuracy after RL)"
    stats = _table(rows, names, seeds, title if train_missing else title + ", finished runs so far")
    _offpolicy_table(rows, names)
    out = (RESULTS_DIR / "quick" if quick else RESULTS_DIR) / "objective_ablation_smollm2.png"
    if not train_missing:
        out = out.with_name("objective_ablation_smollm2.so_far.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    if rows:
        _plot_curves(rows, out)
    summary = {f"{n}_after_mean": m for n, (m, _) in stats.items()} | {
        f"{n}_after_std": s for n, (_, s) in stats.items()
    }
    for key, a, b in (
        ("naive_minus_decoupled", "eta8-naive", "eta8-decoupled"),
        ("decoupled_minus_sync", "eta8-decoupled", "sync"),
    ):
        if a in stats and b in stats:
            summary[key] = stats[a][0] - stats[b][0]
            print(f"{a} - {b}: {summary[key]:+.3f}")
    return {"model": "smollm2-135m", "seeds": list(seeds), "rows": rows, "summary": summary, "plot": str(out)}


def _offpolicy_stats(run_dir) -> dict:
    """What the off-policy corrections did over a run (means over its steps; from metrics.parquet),
    and the engine-vs-trainer logprob gap at the behaviour version over all the tokens it was measured
    on; None for what the run's objective does not record (the naive one has no gap)."""
    import pandas as pd

    m = pd.read_parquet(f"{run_dir}/metrics.parquet")

    def over_steps(col: str, how: str = "mean") -> float | None:
        return float(getattr(m[col], how)()) if col in m else None

    tokens = over_steps("logprob_gap_tokens_sum", "sum") or 0.0
    return {
        "offpolicy_masked_fraction": over_steps("offpolicy_masked_fraction"),
        "offpolicy_truncated_fraction": over_steps("offpolicy_truncated_fraction"),
        "offpolicy_ess": over_steps("offpolicy_ess"),
        "offpolicy_weight_max": over_steps("offpolicy_weight_max", "max"),
        "logprob_gap_mean": over_steps("logprob_gap_sum", "sum") / tokens if tokens else None,
        "logprob_gap_tokens": int(tokens),
    }


def _offpolicy_table(rows: list[dict], names) -> None:
    def mean(mine, key, digits):  # "-" where no run of the setting records it
        xs = [r[key] for r in mine if r[key] is not None]
        return f"{statistics.fmean(xs):.{digits}}" if xs else "-"

    table = []
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        weights = [r["offpolicy_weight_max"] for r in mine if r["offpolicy_weight_max"] is not None]
        table.append(
            (
                name,
                mean(mine, "offpolicy_masked_fraction", "4f"),
                mean(mine, "offpolicy_truncated_fraction", "4f"),
                mean(mine, "offpolicy_ess", "3f"),
                f"{max(weights):.2f}" if weights else "-",
                mean(mine, "logprob_gap_mean", "2e"),
                mean(mine, "tokens_per_s", "0f"),
            )
        )
    print(
        format_table(
            ["setting", "masked", "truncated", "ESS", "max weight", "logprob gap", "train tok/s"],
            table,
            title="what the corrections did (means over steps and seeds) and the engine-vs-trainer gap",
        )
    )


def _plot_curves(rows: list[dict], path) -> None:
    """Batch accuracy per step, mean over seeds, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["setting"] for r in rows):
        curves = [
            pd.read_parquet(f"{r['run_dir']}/metrics.parquet").set_index("step")["accuracy"]
            for r in rows
            if r["setting"] == name
        ]
        runs = f"{len(curves)} run" + ("s" if len(curves) > 1 else "")
        ax.plot(pd.concat(curves, axis=1).mean(axis=1).rolling(3, min_periods=1).mean(), label=f"{name} ({runs})")
    ax.set_xlabel("step")
    ax.set_ylabel("batch accuracy (mean over seeds, 3-step average)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, model: str = "tiny") -> dict:
    if model == "smollm2":
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
    for name, (m, s) in _table(
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
