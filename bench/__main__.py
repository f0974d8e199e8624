"""``python -m bench all|NAME [--quick] [--emulate KIND]``: run benchmarks, print tables, write
bench/results/*.json (--quick: bench/results/quick/*.json, so a quick run never overwrites full
figures; --emulate: with another CPU kind's kernels, into NAME.emulated-KIND.json beside the record of
this CPU's own)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback

from areal_core.numerics import EMULATIONS, emulation_env
from bench import BENCHMARKS, DIAGNOSTICS, LEARNING
from bench.common import RESULTS_DIR, format_table, machine_info, record_kind, save, summarize

HEADLINE = ("async_over_sync", "interruptible_gain", "dynamic_batching_gain", "engine_over_hf_generate")


def results_dir(quick: bool):
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


# set in the process that --emulate starts again with the emulated kernels: the kind it emulates
EMULATING = "AREAL_BENCH_EMULATING"


# the options only some benchmarks take (each passed to their ``run`` by name), and those benchmarks
ONLY_WITH = {"model": ("objective_ablation", "core_lending"), "sync_server_threads": ("trl_peer_smollm2",)}


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def run_one(name: str, quick: bool, emulate: str | None = None, **options) -> dict:
    """Run benchmark ``name`` with ``options`` (``ONLY_WITH``; None: not given) and save its record;
    ``--model`` also names the record (``NAME_MODEL.json``)."""
    mod = importlib.import_module(f"bench.{name}")
    print(f"\n=== {name}{' (quick)' if quick else ''}{f' (emulating {emulate})' if emulate else ''} ===", flush=True)
    t0 = time.perf_counter()
    options = {k: v for k, v in options.items() if v is not None}
    result = mod.run(quick, **options)
    cmd = f"python -m bench {name}" + "".join(f" {_flag(k)} {v}" for k, v in options.items())
    if "model" in options:
        name = f"{name}_{options['model']}"
    suffix = ""
    if emulate is not None:  # the record's machine names the kernels, so summary.json files it under them
        cmd, suffix = f"{cmd} --emulate {emulate}", f".emulated-{emulate}"
    wall = time.perf_counter() - t0
    path = save(name, quick, result, wall, results_dir(quick), cmd=cmd, suffix=suffix)
    summarize(results_dir(quick))
    print(f"[{name}] {wall:.0f}s; wrote {path}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("name", choices=("all",) + BENCHMARKS + LEARNING + DIAGNOSTICS)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps (same outputs)")
    ap.add_argument(
        "--model",
        choices=("smollm2",),
        help="objective_ablation, core_lending: on SmolLM2-135M instead of the tiny model",
    )
    ap.add_argument(
        "--emulate",
        choices=tuple(EMULATIONS),
        help="compute with the kernels of another CPU kind (areal_core.numerics.EMULATIONS): the benchmark "
        "runs again in a process started with them, its record named NAME.emulated-KIND.json",
    )
    ap.add_argument(
        "--sync-server-threads",
        type=int,
        metavar="N",
        help="trl_peer_smollm2: the synchronous run's server on N torch threads (default: every core)",
    )
    args = ap.parse_args(argv)
    for option, benchmarks in ONLY_WITH.items():
        if getattr(args, option) is not None and args.name not in benchmarks:
            ap.error(f"{_flag(option)} goes with {' and '.join(benchmarks)} only")
    if args.sync_server_threads is not None and args.sync_server_threads < 1:
        ap.error("--sync-server-threads takes a thread count >= 1")
    if args.emulate is not None and args.name == "all":
        ap.error("--emulate goes with one benchmark at a time")
    if args.emulate is not None and os.environ.get(EMULATING) != args.emulate:
        # torch, oneDNN and MKL read their kernel caps once, at start: only a fresh process gets them
        try:
            env = {**emulation_env(args.emulate, os.environ), EMULATING: args.emulate}
        except ValueError as e:
            ap.error(str(e))
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "bench", *argv], env)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = BENCHMARKS if args.name == "all" else (args.name,)
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    for name in names:
        try:
            run_one(name, args.quick, args.emulate, **{option: getattr(args, option) for option in ONLY_WITH})
        except Exception as e:  # reported, recorded and reflected in the exit code
            if len(names) == 1:
                raise
            traceback.print_exc()
            failed[name] = repr(e)
            print(f"[{name}] FAILED: {e!r}; going on with the next benchmark", file=sys.stderr, flush=True)
    if args.name == "all":
        wall = time.perf_counter() - t0
        save("all", args.quick, {"summary": {"all_wall_s": wall, "failed": failed}}, wall, results_dir(args.quick))
        summary = summarize(results_dir(args.quick))
        here = summary["by_cpu_kind"][record_kind(machine_info())]
        rows = [(k, next((b["figures"][k] for b in here.values() if k in b["figures"]), None)) for k in HEADLINE]
        print("\n" + format_table(["ratio (higher is better)", "value"], rows, title="summary"))
        print(f"all benchmarks: {wall:.0f}s; failed: {sorted(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
