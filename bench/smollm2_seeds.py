"""A real pretrained model learns: SmolLM2-135M-Instruct on the arithmetic task, full fine-tuning and LoRA,
over several seeds, with GSM8K before and after.

For each variant (``configs/smollm2_quickstart.yaml``: full fine-tuning; ``configs/smollm2_lora.yaml``:
LoRA) and seed S: ``areal-flow train CONFIG --set seed=S`` (fully asynchronous, eta 4), one run after
another, each with the whole machine. Reported per run: held-out greedy accuracy before and after RL
(400 problems of calculations never trained on), the gain, the command's wall time, max staleness
against eta and the ledger check; then GSM8K test (the first 200 problems, greedy, the math
instruction, 256 new tokens) of the base model (once: greedy decoding of one model) and of each run's
final checkpoint, through ``areal-flow eval``. Writes the table, the JSON and a plot
(``smollm2_seeds.png``: batch accuracy per step for every run, and held-out / GSM8K before and after).

A run folder that already holds a finished run of the same config and seed is reused, and so is a
finished GSM8K evaluation (delete the folder to redo it): the runs can be made one at a time, e.g.
``areal-flow train configs/smollm2_lora.yaml --set seed=1 --no-progress --run-dir
runs/bench/smollm2_seeds/lora-seed1``, and the benchmark then only gathers them.

Full: seeds 0-2, both variants (about 3 h on 2 cores). --quick: seed 0, full fine-tuning, 3 steps,
100 held-out problems, GSM8K on 20 problems: it shows the pipeline runs, not the gain.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from bench.common import REPO_ROOT, RESULTS_DIR, format_table
from bench.learning import mean_std, pm, run_row, runs_root, say, train

VARIANTS = {"full": "configs/smollm2_quickstart.yaml", "lora": "configs/smollm2_lora.yaml"}
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2), (0,)
GSM8K_LIMIT, GSM8K_QUICK, GSM8K_TOKENS = 200, 20, 256
QUICK_SETS = ("trainer.max_steps=3", "eval.n_problems=100")


def finished(run_dir: Path, config: str, seed: int, sets: tuple[str, ...]) -> bool:
    """Whether ``run_dir`` holds a finished run of ``config`` at ``seed`` (one to reuse)."""
    if sets or not (run_dir / "summary.json").exists() or not (run_dir / "config.json").exists():
        return False
    ran = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return (
        ran.get("name") == Path(config).stem
        and ran.get("seed") == seed
        and (summary.get("steps") == ran["trainer"]["max_steps"])
    )


def gsm8k(model: str, out: Path, limit: int) -> dict:
    """``areal-flow eval MODEL --bench gsm8k``, greedy; its summary (pass@1 and the run's time). A
    finished evaluation in ``out`` of as many problems is reused."""
    if (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
        bench = summary["benchmarks"]["gsm8k"] if "benchmarks" in summary else summary
        if bench.get("n_problems") == limit:
            say(f"reusing {out} (pass@1 {bench['pass@1']:.3f})")
            return {"pass_at_1": bench["pass@1"], "n": limit, "wall_s": None}
    cmd = [
        str(REPO_ROOT / ".venv" / "bin" / "areal-flow"),
        "eval",
        model,
        "--bench",
        "gsm8k",
        "--limit",
        str(limit),
        "--temperature",
        "0",
        "--max-new-tokens",
        str(GSM8K_TOKENS),
        "--out",
        str(out),
        "--no-progress",
    ]
    say(" ".join(cmd[1:]))
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"gsm8k evaluation of {model} exited with {rc}; see {out.with_suffix('.log')}")
    summary = json.loads((out / "summary.json").read_text())
    bench = summary["benchmarks"]["gsm8k"] if "benchmarks" in summary else summary
    return {"pass_at_1": bench["pass@1"], "n": bench.get("n_problems", limit), "wall_s": time.perf_counter() - t0}


def curves(run_dir: str) -> dict:
    import pandas as pd

    m = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    return {"step": m["step"].tolist(), "accuracy": m["accuracy"].tolist()}


def plot(rows: list[dict], base_gsm8k: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"full": "tab:blue", "lora": "tab:orange"}
    for r in rows:
        c = r["curve"]
        acc = np.convolve(c["accuracy"], np.ones(5) / 5, mode="valid") if len(c["accuracy"]) >= 5 else c["accuracy"]
        ax1.plot(
            c["step"][len(c["step"]) - len(acc) :],
            acc,
            color=colors[r["variant"]],
            alpha=0.8,
            label=f"{r['variant']} seed {r['seed']}",
        )
    ax1.set(
        xlabel="training step",
        ylabel="batch accuracy (5-step mean, sampled at T=0.6)",
        title="SmolLM2-135M-Instruct on the arithmetic task",
    )
    ax1.legend(fontsize=8)
    labels, before, after = [], [], []
    for r in rows:
        labels.append(f"{r['variant']}\ns{r['seed']}")
        before.append((r["before"], base_gsm8k))
        after.append((r["after"], r.get("gsm8k_after")))
    x = np.arange(len(rows))
    for k, (name, hatch) in enumerate((("held-out arithmetic", ""), ("GSM8K test (200)", "//"))):
        ax2.bar(
            x + (k - 0.5) * 0.4 - 0.1,
            [b[k] or 0 for b in before],
            0.2,
            color="lightgray",
            hatch=hatch,
            edgecolor="gray",
            label=f"{name}, before",
        )
        ax2.bar(
            x + (k - 0.5) * 0.4 + 0.1,
            [a[k] or 0 for a in after],
            0.2,
            color=[colors[r["variant"]] for r in rows],
            hatch=hatch,
            edgecolor="black",
            label=f"{name}, after",
        )
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.set(ylabel="greedy accuracy", title="before -> after RL (held-out: 400 problems)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool) -> dict:
    seeds = SEEDS_QUICK if quick else SEEDS_FULL
    variants = {"full": VARIANTS["full"]} if quick else VARIANTS
    root = runs_root("smollm2_seeds" + ("_quick" if quick else ""))
    limit = GSM8K_QUICK if quick else GSM8K_LIMIT
    rows = []
    for variant, config in variants.items():
        for seed in seeds:
            label, sets = f"{variant}-seed{seed}", QUICK_SETS if quick else ()
            if finished(root / label, config, seed, sets):
                say(f"{label}: reusing the finished run in {root / label}")
                row = run_row(label, seed, sets, root / label)
            else:
                row = train(label, seed, sets, root, config=config)
            s = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
            row.update(
                variant=variant,
                ledger_ok=s["ledger_check"].get("ok"),
                eta=s["eta"],
                steps=s["steps"],
                curve=curves(row["run_dir"]),
            )
            rows.append(row)
    base = gsm8k("smollm2-135m", root / "gsm8k-base", limit)
    for r in rows:
        final = Path(r["run_dir"]) / "checkpoints" / f"v{r['steps']}"
        r["gsm8k_after"] = gsm8k(str(final), root / f"gsm8k-{r['label']}", limit)["pass_at_1"]
    print(
        format_table(
            [
                "variant",
                "seed",
                "before",
                "after",
                "gain",
                "wall (s)",
                "RL (s)",
                "max stale / eta",
                "ledger",
                "GSM8K after",
            ],
            [
                (
                    r["variant"],
                    r["seed"],
                    r["before"],
                    r["after"],
                    f"{r['gain']:+.3f}",
                    r["command_wall_s"],
                    r["rl_time_s"],
                    f"{r['max_staleness']} / {r['eta']}",
                    "ok" if r["ledger_ok"] else "FAILED",
                    r["gsm8k_after"],
                )
                for r in rows
            ],
            title=f"SmolLM2-135M-Instruct: held-out arithmetic before -> after RL; GSM8K base {base['pass_at_1']:.3f}",
        )
    )
    summary = {"gsm8k_base": base["pass_at_1"], "gsm8k_n": limit}
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        gains = [r["gain"] for r in mine]
        summary.update(
            {
                f"{variant}_gain_mean": mean_std(gains)[0],
                f"{variant}_gain_std": mean_std(gains)[1],
                f"{variant}_gain_min": min(gains),
                f"{variant}_wall_max_s": max(r["command_wall_s"] for r in mine),
                f"{variant}_gsm8k_after_mean": mean_std([r["gsm8k_after"] for r in mine])[0],
            }
        )
        say(
            f"{variant}: gain {pm(gains)} over seeds {list(seeds)} (min {min(gains):+.3f}); "
            f"wall time max {summary[f'{variant}_wall_max_s']:.0f}s"
        )
    out = (RESULTS_DIR / "quick" if quick else RESULTS_DIR) / "smollm2_seeds.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, base["pass_at_1"], out)
    say(f"wrote {out}")
    return {"seeds": list(seeds), "rows": rows, "summary": summary, "plot": str(out.relative_to(REPO_ROOT))}
