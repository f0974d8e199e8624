"""What TRL's own settings cost: A/B runs of ``bench/trl_worker.py`` on the tiny model, each variant
one GRPOConfig override of the worker's settings, the variants interleaved, several repetitions.

    python -m bench trl_peer_ab [--quick]

The worker's settings (``trl_worker.SPEED`` on top of the algorithm) against TRL's defaults it
turns off, and against settings TRL offers for speed: gradient checkpointing (TRL's default:
on), logging every step (TRL's default: every 10), a static KV cache for ``generate``. Tiny model,
P16 x G8, 96 new tokens (the setting where another GRPOTrainer harness measured TRL 15 % faster
than this worker), STEPS steps of which WARMUP are excluded, one torch thread: each run reports
the worker's CPU seconds per 1,000 trained tokens, which other work on the machine disturbs far
less than the wall clock (also reported, as tokens/s). Same seed, so the variants generate the
same tokens (the table shows tokens per step). Full: REPS_FULL repetitions (about 15 min on an
idle machine); --quick: 1 repetition of fewer steps, a smoke check.
"""

from __future__ import annotations

import os
import statistics
import sys

from bench.common import format_table, work_dir
from bench.trl_peer_inputs import WARMUP, prepare_tiny, tiny_workload
from bench.trl_peer_systems import ensure_venv, run_trl

P, G, T = 16, 8, 96
THREADS = 1
STEPS_FULL, STEPS_QUICK = 8, 4
REPS_FULL, REPS_QUICK = 3, 1
BASE = "worker's settings"
VARIANTS = {
    BASE: {},
    "gradient checkpointing (TRL default)": {"activation_checkpointing": True},
    "logging_steps=10 (TRL default)": {"logging_steps": 10},
    "cache_implementation=static": {"cache_implementation": "static"},
}


def _mean_sd(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return (
        f"{statistics.fmean(xs):.3f} ± {sd:.3f}"
        if statistics.fmean(xs) < 100
        else f"{statistics.fmean(xs):,.0f} ± {sd:,.0f}"
    )


def run(quick: bool) -> dict:
    root = work_dir("trl_peer_ab", quick)
    ensure_venv(str(root / "trl-install.log"))
    steps, reps = (STEPS_QUICK, REPS_QUICK) if quick else (STEPS_FULL, REPS_FULL)
    w = tiny_workload(prepare_tiny(root), P, G, T, steps)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(reps):
        for i, (name, overrides) in enumerate(VARIANTS.items()):
            load = os.getloadavg()[0]
            r = run_trl(w, root / f"rep{rep + 1}" / f"variant{i}", THREADS, overrides)
            r["load_avg_1m"] = [load, os.getloadavg()[0]]
            runs[name].append(r)
            print(
                f"rep {rep + 1}/{reps} {name}: {r['cpu_s_per_1k_tokens']:.3f} CPU s per 1k tokens, "
                f"{r['effective_train_tokens_per_s']:,.0f} tokens/s (load {max(r['load_avg_1m']):.1f})",
                flush=True,
            )
    base_cpu = [r["cpu_s_per_1k_tokens"] for r in runs[BASE]]
    rows, table = [], {}
    for name, rs in runs.items():
        cpu = [r["cpu_s_per_1k_tokens"] for r in rs]
        wall = [r["effective_train_tokens_per_s"] for r in rs]
        rel = [c / b for c, b in zip(cpu, base_cpu)]
        table[name] = {
            "trl_args": VARIANTS[name],
            "cpu_s_per_1k_tokens": cpu,
            "tokens_per_s": wall,
            "cpu_over_worker": rel,
            "tokens_per_step": rs[0]["tokens_trained"] / steps,
            "load_avg_1m_max": max(x for r in rs for x in r["load_avg_1m"]),
        }
        rows.append(
            (
                name,
                _mean_sd(cpu),
                _mean_sd(rel),
                _mean_sd(wall),
                rs[0]["tokens_trained"] / steps,
                table[name]["load_avg_1m_max"],
            )
        )
    print(
        format_table(
            ["variant", "CPU s / 1k tok", "vs worker", "tokens/s (wall)", "tok/step", "load 1m"],
            rows,
            title=f"TRL settings A/B, tiny model P{P} x G{G}, T {T}, {steps} steps ({WARMUP} warm-up "
            f"excluded), {THREADS} thread, {reps} repetition(s) interleaved",
        )
    )
    if quick:
        print("note: --quick is a smoke check (one repetition, few steps): not a result")
    return {
        "setup": {
            "P": P,
            "G": G,
            "max_new_tokens": T,
            "steps": steps,
            "warmup_steps_excluded": WARMUP,
            "threads": THREADS,
            "repetitions": reps,
            "work_dir": str(root),
            "quick": quick,
        },
        "variants": table,
        "summary": {
            "trl_gradient_checkpointing_cpu_cost": statistics.fmean(
                table["gradient checkpointing (TRL default)"]["cpu_over_worker"]
            )
        },
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench trl_peer_ab [--quick]")
