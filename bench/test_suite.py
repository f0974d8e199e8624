"""How long ``make test`` takes: ``python -m bench test_suite [--quick]``.

CI gives the suite 2 cores and asks it to finish within 10 minutes on the slowest CPU kind. This runs
the product's own command, ``make test`` (``ruff check`` and ``ruff format --check``, then pytest with
two xdist workers), on a ready ``.venv``, with the kernels of this CPU and then with AVX2 kernels
only (``areal_core.numerics.EMULATIONS["avx2"]``, as ``bench demo`` emulates a CPU without AVX-512:
the same cores, so an estimate of such a machine, not a measurement of one). On a CPU whose own
kernels are AVX2 the second run is left out (it would repeat the first) and the record says so.

Recorded per kernel set: the command's wall time, pytest's own clock, the counts pytest reports
(passed, failed, skipped, errors), its exit status, the 10 slowest tests (``--durations``), and the
load average before and after (a figure from a machine doing other work says so). A failing run is
recorded as such, its failures named (``make test`` runs pytest with ``-rs``, so the names come from
the FAILURES section's headers).

--quick: ``make test-unit`` with this CPU's kernels: a smoke check, not the suite's time.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from areal_core.numerics import emulation_env
from bench.common import REPO_ROOT, RUNS_DIR, format_table
from bench.demo import _kind, kernel_sets

SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)
DURATION = re.compile(r"^(?P<s>[\d.]+)s (?P<what>call|setup|teardown)\s+(?P<test>\S+)", re.M)
FAILED = re.compile(r"^(?:(?:FAILED|ERROR) (?P<test>\S+)|_{3,} (?P<header>\S+) _{3,}$)", re.M)


def parse_pytest(output: str) -> dict:
    """pytest's last summary line as counts and seconds, the slowest durations it listed, and the tests
    it named as failed or in error."""
    found = list(SUMMARY.finditer(output))
    if not found:
        raise ValueError('no pytest summary line ("N passed ... in Xs") in the output')
    last = found[-1]
    counts = {what: int(n) for n, what in (part.split(" ", 1) for part in last.group("counts").split(", "))}
    durations = [
        {"s": float(m.group("s")), "phase": m.group("what"), "test": m.group("test")} for m in DURATION.finditer(output)
    ]
    return {
        "counts": counts,
        "pytest_s": float(last.group("seconds")),
        "slowest": sorted(durations, key=lambda d: -d["s"])[:10],
        "failed": sorted({m.group("test") or m.group("header") for m in FAILED.finditer(output)}),
    }


def run_suite(target: str, env: dict, log_path) -> dict:
    """``make TARGET`` with ``env``: its wall time, exit status and what pytest reported."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["make", "--no-print-directory", target], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    log_path.write_text(out)
    return {
        "target": target,
        "exit_status": proc.returncode,
        "command_s": wall,
        **parse_pytest(out),
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "log": str(log_path),
    }


def run(quick: bool) -> dict:
    logs = RUNS_DIR / "test_suite"
    logs.mkdir(parents=True, exist_ok=True)
    sets, left_out = kernel_sets(quick)
    rows = []
    for label, emulated in sets.items():
        env = emulation_env(emulated, os.environ)
        kind = _kind(env)
        target = "test-unit" if quick else "test"
        print(f"make {target} with {label} kernels ({kind['aten_capability']}) ...", flush=True)
        r = run_suite(target, env, logs / f"{target}-{kind['aten_capability'].lower()}.log")
        rows.append({"kernels": label, "kind": kind, **r})
        c = r["counts"]
        print(
            f"  {r['command_s'] / 60:.1f} min (pytest {r['pytest_s'] / 60:.1f} min): {c.get('passed', 0)} passed, "
            f"{c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped; exit {r['exit_status']}",
            flush=True,
        )
    print(
        format_table(
            ["kernels", "command", "pytest", "passed", "failed", "skipped", "exit", "load"],
            [
                [
                    r["kernels"],
                    f"{r['command_s'] / 60:.1f} min",
                    f"{r['pytest_s'] / 60:.1f} min",
                    r["counts"].get("passed", 0),
                    r["counts"].get("failed", 0),
                    r["counts"].get("skipped", 0),
                    r["exit_status"],
                    f"{max(r['load_avg_1m']):.1f}",
                ]
                for r in rows
            ],
            title=f"make {'test-unit' if quick else 'test'}",
        )
    )
    for r in rows:
        if r["exit_status"] != 0:
            print(f"FAILED with {r['kernels']} kernels: {', '.join(r['failed']) or 'see ' + r['log']}", flush=True)
    return {"rows": rows, "left_out": left_out, "summary": {"make_test_s": rows[0]["command_s"]}}
