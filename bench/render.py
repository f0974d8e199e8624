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
import re
import sys
from collections.abc import Callable
from pathlib import Path

from areal_core.numerics import kind_label
from areal_core.storage.fsutil import write_text_atomic
from bench.common import REPO_ROOT

DOCS = ("docs/RESULTS.md", "docs/PERFORMANCE.md")
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


def source_line(record: dict) -> str:
    """Where a table's figures come from: command, commit, CPU, load and date of its record."""
    m = record.get("machine", {})
    cpu = kind_label(m["kind"]) if "kind" in m else m.get("cpu", "CPU not recorded")
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


RENDERERS: dict[str, Callable[[dict], str]] = {
    "preemption_slurm.json": preemption_slurm,
    "determinism_cost.json": determinism_costs,
    "determinism.json": determinism,
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
