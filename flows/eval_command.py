"""``areal-flow eval``: a checkpoint or HF model on the shipped benchmarks or a run's held-out split,
or (``--reference``) the benchmarks' own solutions through the graders."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

from flows.cli_input import UsageError


def _stamped(prefix: str) -> Path:
    return Path("runs") / f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _print_eval_summary(summary: dict, out_dir: str) -> None:
    print(f"\nmodel: {summary['model']}   results: {out_dir}")
    for b in summary["benchmarks"].values():
        k = b["samples"]
        extra = f"  maj@{k} {b[f'maj@{k}']:.3f}" if f"maj@{k}" in b else ""
        passk = f"  pass@{k} {b[f'pass@{k}']:.3f}" if k > 1 else ""
        print(
            f"  {b['label']}: {b['n_problems']} problems x {k} samples  pass@1 {b['pass@1']:.3f}"
            f"{passk}{extra}  mean length {b['mean_length']:.0f} tokens "
            f"(truncated {b['truncated_share']:.0%})"
        )


# the grading settings (a run's reward section) and the flags of `areal-flow eval` that give them
_GRADING_FLAGS = {
    "scheduler_address": ("scheduler", "--scheduler"),
    "tls_ca_file": ("tls_ca_file", "--tls-ca-file"),
    "tls_client_cert": ("tls_cert", "--tls-cert"),
    "tls_client_key": ("tls_key", "--tls-key"),
}


def _grading(args):
    """Where the answers are graded: --scheduler (with its --tls-* files), else a local Dask cluster."""
    from areal_core.eval.harness import grading_config

    given = {key: getattr(args, attr) for key, (attr, _) in _GRADING_FLAGS.items() if getattr(args, attr) is not None}
    try:
        return grading_config(given or None)
    except ValueError as e:
        text = str(e)
        for key, (_, flag) in _GRADING_FLAGS.items():  # (the settings' names, with or without "reward.")
            text = re.sub(rf"\b(reward\.)?{key}\b", flag, text)
        raise UsageError(text) from None


def _eval_reference(args) -> int:
    from areal_core.eval.harness import reference_check

    if args.model:
        raise UsageError("--reference checks the data's own solutions; give no model")
    reports = [
        reference_check(b, limit=args.limit, grading=_grading(args), progress=not args.no_progress) for b in args.bench
    ]
    for r in reports:
        for f in r["failures"][:20]:
            print(f"  failed {f['id']}: {f['reason']} (parsed {f['parsed'][:80]!r})")
        print(f"{r['label']}: {r['n_correct']}/{r['n_with_reference']} references graded correct")
    n = sum(r["n_with_reference"] for r in reports)
    ok = sum(r["n_correct"] for r in reports)
    result = {
        "benches": [{k: v for k, v in r.items() if k != "failures"} for r in reports],
        "n": n,
        "correct": ok,
        "accuracy": ok / n,
    }
    if args.out:
        from areal_core.storage import write_json_atomic

        write_json_atomic(
            str(Path(args.out) / "reference.json"), {**result, "failures": {r["label"]: r["failures"] for r in reports}}
        )
        print(f"written: {Path(args.out) / 'reference.json'}")
    print(json.dumps(result))
    return 0


def cmd_eval(args) -> int:
    from areal_core.eval.benchmarks import BENCHMARKS
    from areal_core.eval.harness import HELDOUT

    unknown = [b for b in args.bench if b not in BENCHMARKS and b != HELDOUT]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}, {HELDOUT}")
    if args.reference:
        if HELDOUT in args.bench:
            raise UsageError(f"--reference checks the shipped benchmarks' own solutions, not '{HELDOUT}'")
        return _eval_reference(args)
    if not args.model:
        raise UsageError("give a CHECKPOINT_OR_MODEL to evaluate (or --reference)")
    from areal_core.eval.harness import check_model_arg, evaluate_checkpoint, run_folder_of

    try:
        check_model_arg(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_dir = args.run_dir or run_folder_of(args.model)
    if HELDOUT in args.bench and not (run_dir and os.path.isfile(os.path.join(run_dir, "config.json"))):
        raise UsageError(
            f"--bench {HELDOUT} evaluates on a training run's own held-out split: give a run's "
            f"checkpoint (RUN/checkpoints/vN) or --run-dir RUN (a folder with the run's config.json)"
        )

    out_dir = args.out or str(_stamped("eval"))
    summary = evaluate_checkpoint(
        args.model,
        args.bench,
        out_dir=out_dir,
        samples=args.samples,
        limit=args.limit,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        grading=_grading(args),
        progress=not args.no_progress,
        run_dir=run_dir,
    )
    _print_eval_summary(summary, out_dir)
    return 0
