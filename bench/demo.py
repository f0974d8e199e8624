"""How long ``make demo`` takes a newcomer: the first run (its warm start trained) and a later one (the
warm start from the cache), with the kernels of this CPU and, beside them, with AVX2 kernels only
(``areal_core.numerics.EMULATIONS["avx2"]``: torch's, oneDNN's and MKL's kernels capped at AVX2, the
arithmetic of a CPU without AVX-512, emulated here; the same cores, so an estimate of such a machine,
not a measurement of one). On a CPU whose own kernels are AVX2 the emulated pair is left out (it
would repeat the first) and the record says so.

Each pair is the product's own command, ``make demo DEMO_DIR=...`` with ``AREAL_FLOW_CACHE`` an empty
folder of its own, then again into a new folder with the same cache; then ``make demo`` into the
finished folder once more, which must refuse at once with its one line. The times are the command's
(Python's and Prefect's start-up included) and the run's own (its summary). The installation is not
timed (``make demo`` on a ready ``.venv``).

--quick: the native kernels' first run alone: a smoke check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_core.numerics import emulation_env
from bench.common import REPO_ROOT, RUNS_DIR, format_table
from bench.learning import say

# each set of kernels: the emulated kind (areal_core.numerics.EMULATIONS), None for this CPU's own
KERNELS = {"this CPU's": None, "AVX2 only (emulated)": "avx2"}


def _kind(env: dict) -> dict:
    """The CPU kind and kernels a process started with ``env`` computes with."""
    code = "import json; from areal_core.numerics import cpu_kind; print(json.dumps(cpu_kind()))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def kernel_sets(quick: bool) -> tuple[dict[str, str | None], str | None]:
    """The sets of ``KERNELS`` a benchmark runs here (this CPU's alone if ``quick``), and the one left
    out with why: an emulation whose kernels are this CPU's own (an AVX2-only CPU) would repeat its run."""
    if quick:
        return {"this CPU's": KERNELS["this CPU's"]}, None
    own = _kind(emulation_env(None, os.environ))["aten_capability"]
    sets, left_out = {}, None
    for label, emulated in KERNELS.items():
        if emulated and _kind(emulation_env(emulated, os.environ))["aten_capability"] == own:
            left_out = f"{label}: this CPU's own kernels are {own} already"
            say(f"left out {left_out}")
        else:
            sets[label] = emulated
    return sets, left_out


def _make_demo(run_dir: Path, env: dict, log: Path) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["make", "--no-print-directory", "demo", f"DEMO_DIR={run_dir}"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, wall, proc.stdout + proc.stderr


def _row(kernels: str, which: str, run_dir: Path, command_s: float, kind: dict) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "kernels": kernels,
        "run": which,
        "command_s": command_s,
        "run_wall_s": s["wall_time_s"],
        "rl_time_s": s["rl_time_s"],
        "before": s["accuracy_before"],
        "after": s["accuracy_after"],
        "tokens_per_s": s["effective_train_tokens_per_s"],
        "kind": kind,
    }


def _pair(kernels: str, emulated: str | None, root: Path, quick: bool) -> list[dict]:
    env = emulation_env(emulated, os.environ)
    env["AREAL_FLOW_CACHE"] = tempfile.mkdtemp(prefix="cache-", dir=root)  # empty: the warm start is trained
    kind = _kind(env)
    slug = emulated or "native"
    rows = []
    for which in ("first", "later")[: 1 if quick else 2]:
        run_dir = root / f"{slug}-{which}"
        say(f"{kernels} kernels, {which} run: make demo DEMO_DIR={run_dir}")
        rc, wall, out = _make_demo(run_dir, env, root / f"{slug}-{which}.log")
        if rc != 0:
            raise RuntimeError(f"make demo exited with {rc}; see {root / f'{slug}-{which}.log'}")
        rows.append(_row(kernels, which, run_dir, wall, kind))
        say(f"  {wall:.0f} s for the command, {rows[-1]['run_wall_s']:.0f} s the run's own")
    rc, wall, out = _make_demo(run_dir, env, root / f"{slug}-again.log")
    refused = rc == 0 and "holds a finished demo" in out and len(out.strip().splitlines()) == 1
    rows[-1]["again_refused"] = refused
    rows[-1]["again_s"] = wall
    if not refused:
        raise RuntimeError(f"make demo into a finished demo did not refuse with its one line: {out[-2000:]}")
    return rows


def run(quick: bool) -> dict:
    root = RUNS_DIR / "bench-demo"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = []
    sets, left_out = kernel_sets(quick)
    for kernels, emulated in sets.items():
        rows += _pair(kernels, emulated, root, quick)
    table = [
        [
            r["kernels"],
            r["run"],
            f"{r['command_s']:.0f} s",
            f"{r['run_wall_s']:.0f} s",
            f"{r['rl_time_s']:.0f} s",
            f"{r['before']:.3f} -> {r['after']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
        ]
        for r in rows
    ]
    heads = ["kernels", "run", "command", "run's wall", "RL time", "held-out", "tokens/s"]
    print(format_table(heads, table))
    shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "left_out": left_out}
