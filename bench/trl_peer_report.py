"""Repetitions of the TRL peer comparison and their report: the three systems run in turn (TRL, sync,
async, TRL, sync, async, ...), so that whatever else the machine does falls on all three alike;
each system's effective train tokens/s per repetition with mean ± sd, min and max; the ratios
async/TRL, async/sync and sync/TRL per repetition."""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

from bench.common import format_table, ratio
from bench.trl_peer_inputs import CORES, WARMUP, Workload
from bench.trl_peer_systems import SYSTEMS, TRL, run_system

RATIOS = (
    ("async_over_trl", "areal-flow async", TRL),
    ("async_over_sync", "areal-flow async", "areal-flow sync"),
    ("sync_over_trl", "areal-flow sync", TRL),
)


def stats(xs: list[float]) -> dict:
    """mean, sd (0 for one value), min, max of repeated measurements, and the values themselves."""
    return {
        "mean": statistics.fmean(xs),
        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "values": list(xs),
    }


def pm(s: dict) -> str:
    return f"{s['mean']:,.0f} ± {s['sd']:,.0f}" if s["mean"] >= 100 else f"{s['mean']:.2f} ± {s['sd']:.2f}"


def repetition_ratios(runs: dict) -> dict:
    eff = {k: v["effective_train_tokens_per_s"] for k, v in runs.items()}
    return {name: ratio(eff[a], eff[b]) for name, a, b in RATIOS}


def summarize(w: Workload, reps: list[dict]) -> dict:
    """The repetitions' figures per system and the ratios per repetition, with their spread."""
    systems = {label: stats([r["runs"][label]["effective_train_tokens_per_s"] for r in reps]) for label in SYSTEMS}
    ratios = {name: stats([r["ratios"][name] for r in reps]) for name, _, _ in RATIOS}
    loads = [x for r in reps for run in r["runs"].values() for x in run["load_avg_1m"]]
    return {
        "workload": dataclasses.asdict(w),
        "warmup_steps_excluded": WARMUP,
        "cores": CORES,
        "effective_train_tokens_per_s": systems,
        "ratios": ratios,
        "load_avg_1m_max": max(loads),
        "repetitions": reps,
    }


def run_repetitions(w: Workload, n: int, root: Path, reward: dict | None) -> dict:
    """``n`` repetitions of the three systems on ``w``, interleaved; printed as they finish."""
    reps = []
    for i in range(n):
        runs = {}
        for label in SYSTEMS:
            print(f"{w.name} {w.tag()} repetition {i + 1}/{n}: {label}, {w.steps} steps ...", flush=True)
            runs[label] = run_system(label, w, root / w.tag() / f"rep{i + 1}", reward)
            print(
                f"  {runs[label]['effective_train_tokens_per_s']:,.0f} tokens/s "
                f"(load {max(runs[label]['load_avg_1m']):.1f})",
                flush=True,
            )
        reps.append({"runs": runs, "ratios": repetition_ratios(runs)})
    return summarize(w, reps)


def _mean_of(runs: list[dict], key: str) -> float | None:
    """The mean of ``key`` over ``runs`` (None where a run has none: TRL, or a record made before it was kept)."""
    xs = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(xs) if len(xs) == len(runs) else None


def print_report(title: str, res: dict, quick: bool) -> None:
    reps = res["repetitions"]
    heads = ["system"] + [f"rep {i + 1}" for i in range(len(reps))]
    parts = ("mean_train_s", "mean_rollout_wait_s", "mean_own_threads_s", "mean_lent_threads_s", "mean_generating_s")
    heads += ["mean ± sd", "min", "max", "step s", "of it training", "waiting for answers"]
    heads += ["on its own threads", "on lent ones too", "server generating", "reward"]
    rows = []
    for label in SYSTEMS:
        s = res["effective_train_tokens_per_s"][label]
        runs = [r["runs"][label] for r in reps]
        rewards = [r["reward_mean"] for r in runs if r.get("reward_mean") is not None]
        rows.append(
            [label]
            + s["values"]
            + [
                pm(s),
                s["min"],
                s["max"],
                statistics.fmean(r["mean_step_s"] for r in runs),
                *(_mean_of(runs, k) for k in parts),
                statistics.fmean(rewards) if rewards else None,
            ]
        )
    w = res["workload"]
    print(
        format_table(
            heads,
            rows,
            title=f"{title}: effective train tokens/s, {w['steps']} steps of which "
            f"{WARMUP} warm-up excluded, {CORES} cores",
        )
    )
    rows = [[name] + r["values"] + [pm(r), r["min"], r["max"]] for name, r in res["ratios"].items()]
    print(format_table(["ratio"] + [f"rep {i + 1}" for i in range(len(reps))] + ["mean ± sd", "min", "max"], rows))
    trl = [r["runs"][TRL].get("clocks") for r in reps]
    if all(trl):
        print(
            "TRL's clocks, every step (tokens/s): "
            + "; ".join(
                f"rep {i + 1}: steps {c['step_clock_tokens_per_s']:,.0f}, train() {c['train_call_tokens_per_s']:,.0f}, "
                f"train_runtime {c['trl_train_runtime_tokens_per_s']:,.0f}"
                for i, c in enumerate(trl)
            )
        )
    if res["load_avg_1m_max"] > CORES:
        print(
            f"note: load average up to {res['load_avg_1m_max']:.1f} on {os.cpu_count()} cores: other work shared "
            f"the cores, and TRL's {CORES} OpenMP threads suffer most from that; compare on an idle machine"
        )
    if quick:
        print(
            "note: --quick is a smoke check of the pipeline (few steps, one repetition): its figures and ratios "
            "are not results"
        )
