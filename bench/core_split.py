"""Where the cores go: CPU per process of a synchronous and an asynchronous quickstart run.

Runs ``configs/quickstart.yaml`` twice in this process, synchronous (eta 0, drain) and
asynchronous (eta 4, as shipped), for the same number of steps. A sampling thread reads
``/proc`` every 0.5 s: CPU seconds of every thread of this (the trainer's) process and of
every process it started (rollout server, Dask scheduler, nanny and worker). Reported per
role: cores = CPU seconds / RL seconds, and the total; then core-seconds per step.
A diagnostic (Linux only), not part of ``bench all``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench.common import REPO_ROOT, format_table, ratio, work_dir

CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
STEPS_FULL, STEPS_QUICK = 100, 20
SETTINGS = (("sync (eta 0, drain)", {"trainer.eta": 0, "rollout.weight_update": "drain"}), ("async (eta 4)", {}))
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for c in kids:
            out += [c, *_children(c)]
    return out


def _role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read().replace("\0", " ")
    if "areal_core.rollout.backends.embedded.server" in cmd:
        return "rollout server (generation)"
    if "distributed.Scheduler" in cmd:
        return "Dask scheduler"
    if "multiprocessing.spawn" in cmd:
        return "Dask worker (grading)"
    if "dask spec" in cmd:
        return "Dask nanny"
    return "other processes"


def _sample() -> dict[tuple[str, int], float]:
    """CPU seconds so far, keyed by (role, pid or thread id)."""
    me = os.getpid()
    out = {}
    for tid in os.listdir(f"/proc/{me}/task"):
        role = "trainer: main thread" if int(tid) == me else "trainer process: other threads"
        try:
            out[(role, int(tid))] = _cpu_s(f"/proc/{me}/task/{tid}/stat")
        except OSError:
            pass
    for pid in _children(me):
        try:
            out[(_role(pid), pid)] = _cpu_s(f"/proc/{pid}/stat")
        except OSError:
            pass
    return out


def _measure(cfg, run_dir: Path, steps: int) -> tuple[dict, dict[str, float]]:
    from areal_core.run.setup import run_experiment

    first: dict = {}
    last: dict = {}
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            for k, v in _sample().items():
                first.setdefault(k, v)
                last[k] = v
            time.sleep(0.5)

    th = threading.Thread(target=sampler, name="core-split-sampler", daemon=True)
    th.start()
    try:
        summary = run_experiment(cfg, run_dir, max_steps=steps, progress=False)
    finally:
        stop.set()
        th.join()
    by_role: dict[str, float] = {}
    for k, v in last.items():
        by_role[k[0]] = by_role.get(k[0], 0.0) + v - first[k]
    return summary, by_role


def run(quick: bool) -> dict:
    from areal_core.experiment import load_config

    steps = STEPS_QUICK if quick else STEPS_FULL
    root = work_dir("core_split", quick)
    runs = {}
    for label, over in SETTINGS:
        cfg = load_config(CONFIG, {**over, "eval.n_problems": 16, "name": "bench-cores"})
        print(f"{label}: {steps} steps ...", flush=True)
        summary, cpu = _measure(cfg, root / label.split()[0], steps)
        rl_s = summary["rl_time_s"]
        runs[label] = {
            "rl_time_s": rl_s,
            "steps": steps,
            "effective_train_tokens_per_s": summary["effective_train_tokens_per_s"],
            "cores": {k: v / rl_s for k, v in cpu.items()},
            "cpu_s": cpu,
            "core_s_per_step": sum(cpu.values()) / steps,
        }
    roles = sorted({r for x in runs.values() for r in x["cores"]})
    labels = [lbl for lbl, _ in SETTINGS]
    rows = [(r, *(runs[lbl]["cores"].get(r, 0.0) for lbl in labels)) for r in roles]
    rows.append(("total", *(sum(runs[lbl]["cores"].values()) for lbl in labels)))
    rows.append(("core-seconds per step", *(runs[lbl]["core_s_per_step"] for lbl in labels)))
    rows.append(("RL seconds", *(runs[lbl]["rl_time_s"] for lbl in labels)))
    rows.append(("train tokens/s", *(runs[lbl]["effective_train_tokens_per_s"] for lbl in labels)))
    print(
        format_table(["cores (CPU s / RL s)", *labels], rows, title=f"quickstart, {steps} steps each, CPU by process")
    )
    sync, asyn = (runs[lbl]["effective_train_tokens_per_s"] for lbl in labels)
    return {
        "setup": {"config": str(CONFIG.relative_to(REPO_ROOT)), "steps": steps, "sample_interval_s": 0.5},
        "runs": runs,
        "summary": {"core_split_async_over_sync": ratio(asyn, sync)},
    }
