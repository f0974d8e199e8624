"""Shared pieces of the benchmarks: result files, plain-text tables, machine facts, timing.

Every benchmark module exposes ``run(quick: bool) -> dict``. The dict it returns
is written to ``bench/results/<name>.json`` (atomically) by :func:`save`, and its
``"summary"`` entry (flat ratios and figures) is gathered, per CPU kind, into
``bench/results/summary.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from areal_core.storage.fsutil import write_text_atomic

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS_DIR = REPO_ROOT / "runs" / "bench"  # the benchmarks' runs, logs and models (gitignored)


def work_dir(name: str, quick: bool = False) -> Path:
    """The folder one benchmark writes its models, logs and checkpoints into: ``runs/bench/<name>``
    (``<name>_quick`` for --quick), emptied first. The disk holds the files of each benchmark's latest
    run, where its results' paths point, instead of a new temporary copy on every run (a SmolLM2
    benchmark's checkpoints take gigabytes)."""
    root = RUNS_DIR / (name + ("_quick" if quick else ""))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def venv_install_commands(venv: Path, install: list[list[str]]) -> str:
    """The shell line that creates a peer's venv and runs ``install`` (``{py}``: its python)."""
    py = (venv / "bin" / "python").relative_to(REPO_ROOT)
    lines = [f"python3.11 -m venv {venv.relative_to(REPO_ROOT)}"]
    lines += [" ".join(c).replace("{py}", str(py)) for c in install]
    return " && ".join(lines)


def install_venv(
    venv: Path, install: list[list[str]], log_path: str, may_fail: Callable[[list[str]], bool] = lambda cmd: False
) -> str | None:
    """Create ``venv`` if missing and run the ``install`` commands into it, logging to
    ``log_path``; returns why a command failed (one ``may_fail`` accepts is passed over), or None."""
    py = venv / "bin" / "python"
    steps = [] if py.exists() else [["python3.11", "-m", "venv", str(venv)]]
    steps += [[a.replace("{py}", str(py)) for a in c] for c in install]
    with open(log_path, "ab") as log:
        for cmd in steps:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
            if r.returncode != 0 and not may_fail(cmd):
                return f"`{' '.join(cmd)}` exited with {r.returncode}; see {log_path}"
    return None


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (numpy / torch scalars become numbers)."""
    write_text_atomic(str(path), json.dumps(obj, indent=2, default=_jsonable) + "\n")


def _jsonable(x):
    if hasattr(x, "item"):  # numpy / torch scalars
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def fmt(x, digits: int = 3) -> str:
    """A number for a table: ints as they are, floats with ``digits`` significant-ish digits."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        a = abs(x)
        if a >= 1000:
            return f"{x:,.0f}"
        if a >= 100:
            return f"{x:.1f}"
        if a >= 1:
            return f"{x:.{max(0, digits - 1)}f}"
        return f"{x:.{digits}f}"
    return str(x)


def format_table(headers: Sequence[str], rows: Iterable[Sequence], title: str | None = None) -> str:
    """A plain-text table with right-aligned numbers and left-aligned text."""
    body = [[fmt(c) for c in r] for r in rows]
    cols = list(zip(*([list(headers)] + body))) if body else [[h] for h in headers]
    widths = [max(len(str(c)) for c in col) for col in cols]
    numeric = [all(_looks_numeric(r[i]) for r in body) if body else False for i in range(len(headers))]

    def line(cells):
        return "  ".join(
            str(c).rjust(w) if num else str(c).ljust(w) for c, w, num in zip(cells, widths, numeric)
        ).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in body)
    return "\n".join(out)


def _looks_numeric(s: str) -> bool:
    s = s.replace(",", "").replace("x", "").replace("%", "")
    if s in ("-", ""):
        return True
    try:
        float(s)
    except ValueError:
        return False
    return True


def synthetic_answer(traj_id: str, group_id: str, seq_no: int, prompt: list[int], out: list[int], reward: float):
    """A finished answer for the trainer's benchmarks: generated at version 0, its sampling
    log-probabilities placeholders (-1 a token), stopped on its own."""
    from areal_core.types import Trajectory

    return Trajectory(
        traj_id=traj_id,
        group_id=group_id,
        seq_no=seq_no,
        admit_version=0,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-1.0] * len(out),
        output_versions=[0] * len(out),
        finish_reason="stop",
        reward=reward,
        correct=None,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> dict:
    """Median, min, max of repeated measurements (kept so noise is visible)."""
    xs = list(xs)
    return {"median": median(xs), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("flags"):
                    flags = ln
                    break
    except OSError:
        pass
    from areal_core.numerics import cpu_kind

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        # vendor, family/model, the instruction sets that pick kernels, the kernels in use, MKL's mode
        "kind": cpu_kind(),
        "load_average_1m": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def command(name: str, quick: bool) -> str:
    return f"python -m bench {name}" + (" --quick" if quick else "")


def code_commit() -> str:
    """The checkout's commit (short), with ``+changes`` where its code differs from it (files outside
    bench/results/, docs/ and README.md); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    changed = [
        ln[3:] for ln in status.stdout.splitlines() if not ln[3:].startswith(("bench/results/", "docs/", "README.md"))
    ]
    return head.stdout.strip() + ("+changes" if changed else "")


def save(
    name: str,
    quick: bool,
    result: dict,
    wall_s: float,
    results_dir: Path = RESULTS_DIR,
    cmd: str | None = None,
    suffix: str = "",
) -> Path:
    """Write ``result`` (plus machine facts, the command and the commit) to
    ``results_dir/<name><suffix>.json``; ``cmd``: the command that made it, where it is not
    ``python -m bench <name>``."""
    payload = {
        "benchmark": name,
        "command": command(name, quick) if cmd is None else cmd + (" --quick" if quick else ""),
        "commit": code_commit(),
        "quick": quick,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall_s,
        "machine": machine_info(),
        **result,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}{suffix}.json"
    write_json_atomic(path, _repo_relative(payload))
    return path


def _repo_relative(x):
    """``x`` with every path inside this checkout written relative to its root (results name no machine's folder)."""
    if isinstance(x, dict):
        return {k: _repo_relative(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_repo_relative(v) for v in x]
    if isinstance(x, (str, Path)):  # a path, or a text naming some (joined lists, messages)
        return str(x).replace(f"{REPO_ROOT}{os.sep}", "")
    return x


def record_kind(machine: dict) -> str:
    """The CPU kind a record's ``machine`` names (``kind_label``); older records, which named the CPU
    and its bf16 units only, by those."""
    from areal_core.numerics import kind_label

    if "kind" in machine:
        return kind_label(machine["kind"])
    bf16 = "avx512_bf16" if machine.get("avx512_bf16") else "no avx512_bf16"
    return f"{machine.get('cpu') or '?'} ({bf16}; kernels not recorded)"


def summarize(results_dir: Path = RESULTS_DIR) -> dict:
    """``summary.json`` rebuilt from the records in ``results_dir``: per CPU kind (``record_kind``),
    each benchmark's latest record there (its file, command, commit, date, wall time) and the headline
    figures it gave (its ``summary``). A run on one kind never replaces another kind's figures."""
    kinds: dict[str, dict] = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.name == "summary.json":
            continue
        r = json.loads(path.read_text())
        if not isinstance(r, dict) or "benchmark" not in r or "machine" not in r:
            continue
        entry = {
            "record": path.name,
            **{k: r.get(k) for k in ("command", "commit", "finished_at", "wall_s")},
            "figures": r.get("summary", {}),
        }
        mine = kinds.setdefault(record_kind(r["machine"]), {})
        if r["benchmark"] not in mine or (mine[r["benchmark"]]["finished_at"] or "") < (entry["finished_at"] or ""):
            mine[r["benchmark"]] = entry
    summary = {"by_cpu_kind": {k: dict(sorted(v.items())) for k, v in sorted(kinds.items())}}
    write_json_atomic(results_dir / "summary.json", summary)
    return summary


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` (perf_counter seconds)."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0


def progress(iterable=None, total: int | None = None, desc: str = "", disable: bool = False):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=disable, leave=False, file=sys.stderr)
