"""Asynchronous vs synchronous RL, end to end: the quickstart with eta in {0 (sync), 1, 4, 8}.

Each setting is one ``run_experiment`` of ``configs/quickstart.yaml`` (tiny model,
synthetic chain-sum task with heavy-tailed answer lengths, B = 128, one rollout server
with one thread, trainer with one thread, one Dask reward worker: the same 2 cores),
changed only by ``trainer.eta`` and ``rollout.weight_update``:

* sync: eta 0 + weight_update drain (exactly ``configs/quickstart_sync.yaml``);
* async: eta 1, 4, 8 + the quickstart's weight_update (the quickstart's setting is eta 4).

Measured: effective training throughput (``summary["effective_train_tokens_per_s"]``:
generated tokens consumed by training per second, after the first 2 steps) and
greedy held-out accuracy after the same number of steps.

Steps: the quickstart runs 200 steps (about 10 min each on an idle machine); four of
them do not fit in the 40-minute budget of ``python -m bench all`` beside the other
benchmarks, so full mode runs STEPS_FULL steps per setting. --quick runs STEPS_QUICK steps
of BATCH_QUICK answers on EVAL_QUICK problems: it shows that the pipeline runs, its ratios
are noise.
"""

from __future__ import annotations

from bench.common import REPO_ROOT, format_table, ratio, work_dir

CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
SETTINGS = (("sync (eta 0)", 0, "drain"), ("eta 1", 1, None), ("eta 4", 4, None), ("eta 8", 8, None))
STEPS_FULL, STEPS_QUICK = 100, 3
EVAL_FULL, EVAL_QUICK = 500, 24
BATCH_QUICK = 32  # --quick: 4 prompts x 8 answers per step (the quickstart's B = 128 in full mode)
KEEP = (
    "accuracy_before",
    "accuracy_after",
    "n_eval_problems",
    "steps",
    "eta",
    "weight_update",
    "max_staleness_observed",
    "effective_train_tokens_per_s",
    "tokens_trained",
    "rl_time_s",
    "wall_time_s",
    "trained_answer_length",
)


def run(quick: bool) -> dict:
    from areal_core.experiment import load_config
    from areal_core.reward.service import RewardService
    from areal_core.run.setup import run_experiment

    steps = STEPS_QUICK if quick else STEPS_FULL
    n_eval = EVAL_QUICK if quick else EVAL_FULL
    batch = {"trainer.batch_size": BATCH_QUICK} if quick else {}
    root = work_dir("async_vs_sync", quick)
    runs = {}
    # one Dask cluster, the one the config's reward section would start in each run, serves every setting
    with RewardService(load_config(CONFIG).reward) as shared:
        for label, eta, mode in SETTINGS:
            cfg = load_config(
                CONFIG,
                {
                    "trainer.eta": eta,
                    **({"rollout.weight_update": mode} if mode else {}),
                    "eval.n_problems": n_eval,
                    **{f"reward.{k}": v for k, v in shared.client_settings().items()},
                    "name": f"bench-{label.split()[0]}-{eta}",
                    **batch,
                },
            )
            print(f"{label}: {steps} steps, {n_eval} held-out problems ...", flush=True)
            run_dir = root / "".join(ch if ch.isalnum() else "-" for ch in label)
            summary = run_experiment(cfg, run_dir, max_steps=steps, progress=True)
            runs[label] = {k: summary.get(k) for k in KEEP}
            runs[label]["run_dir"] = str(run_dir)
    sync = runs["sync (eta 0)"]
    rows = []
    for label, r in runs.items():
        rows.append(
            (
                label,
                r["effective_train_tokens_per_s"],
                ratio(r["effective_train_tokens_per_s"], sync["effective_train_tokens_per_s"]),
                r["rl_time_s"],
                r["max_staleness_observed"],
                r["accuracy_before"],
                r["accuracy_after"],
                100 * (r["accuracy_after"] - sync["accuracy_after"]),
            )
        )
    print(
        format_table(
            ["setting", "train tok/s", "over sync", "RL s", "max stale", "acc before", "acc after", "acc - sync (pts)"],
            rows,
            title=f"quickstart, {steps} steps each, held-out accuracy on {n_eval} problems",
        )
    )
    e4 = runs["eta 4"]
    return {
        "setup": {
            "config": str(CONFIG.relative_to(REPO_ROOT)),
            "steps_per_setting": steps,
            "batch_size": BATCH_QUICK if quick else cfg.trainer.batch_size,
            "eval_problems": n_eval,
            "why_not_all_quickstart_steps": "4 x 200 quickstart steps (~10 min each on an idle machine) do not fit "
            "in the 40-minute budget of `python -m bench all` with the other benchmarks",
            "settings": [{"label": lbl, "eta": e, "weight_update": m or "as configured"} for lbl, e, m in SETTINGS],
        },
        "runs": runs,
        "summary": {
            "async_over_sync": ratio(e4["effective_train_tokens_per_s"], sync["effective_train_tokens_per_s"]),
            **{
                f"async_over_sync_{label.replace(' ', '').replace('(', '_').replace(')', '')}": ratio(
                    r["effective_train_tokens_per_s"], sync["effective_train_tokens_per_s"]
                )
                for label, r in runs.items()
                if label not in ("sync (eta 0)", "eta 4")
            },
            "async_accuracy_minus_sync_points": 100 * (e4["accuracy_after"] - sync["accuracy_after"]),
            "async_vs_sync_steps": steps,
        },
    }
