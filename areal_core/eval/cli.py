"""``areal-flow eval``: evaluate a checkpoint on benchmarks, or self-check a benchmark's references."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path


def _print_summary(summary: dict, out_dir: str) -> None:
    print(f"\nmodel: {summary['model']}   results: {out_dir}")
    for name, b in summary["benchmarks"].items():
        k = b["samples"]
        extra = f"  maj@{k} {b[f'maj@{k}']:.3f}" if f"maj@{k}" in b else ""
        passk = f"  pass@{k} {b[f'pass@{k}']:.3f}" if k > 1 else ""
        print(f"  {b['label']}: {b['n_problems']} problems x {k} samples  pass@1 {b['pass@1']:.3f}"
              f"{passk}{extra}  mean length {b['mean_length']:.0f} tokens "
              f"(truncated {b['truncated_share']:.0%})")


def cmd_eval(args) -> int:
    from areal_core.eval.benchmarks import BENCHMARKS

    unknown = [b for b in args.bench if b not in BENCHMARKS]
    if unknown:
        print(f"error: unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if args.reference:
        if args.model:
            print("error: --reference checks the data's own solutions; give no model", file=sys.stderr)
            return 2
        from areal_core.eval.harness import reference_check

        reports = [reference_check(b, limit=args.limit, scheduler_address=args.scheduler,
                                   progress=not args.no_progress) for b in args.bench]
        for r in reports:
            for f in r["failures"][:20]:
                print(f"  failed {f['id']}: {f['reason']} (parsed {f['parsed'][:80]!r})")
            print(f"{r['label']}: {r['n_correct']}/{r['n_with_reference']} references graded correct")
        n = sum(r["n_with_reference"] for r in reports)
        ok = sum(r["n_correct"] for r in reports)
        brief = [{k: v for k, v in r.items() if k != "failures"} for r in reports]
        print(json.dumps({"benches": brief, "n": n, "correct": ok, "accuracy": ok / n}))
        return 0
    if not args.model:
        print("error: give a CHECKPOINT_OR_MODEL to evaluate (or --reference)", file=sys.stderr)
        return 2
    from areal_core.eval.harness import evaluate_checkpoint

    out_dir = args.out or str(Path("runs") / f"eval-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    summary = evaluate_checkpoint(
        args.model, args.bench, out_dir=out_dir, samples=args.samples, limit=args.limit,
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        scheduler_address=args.scheduler, progress=not args.no_progress,
    )
    _print_summary(summary, out_dir)
    return 0


def add_eval_command(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a checkpoint or model on benchmarks (or --reference self-check)")
    e.add_argument("model", nargs="?", metavar="CHECKPOINT_OR_MODEL",
                   help="checkpoint version folder/URL, HF model folder, or smollm2-135m")
    e.add_argument("--bench", action="append", required=True, metavar="NAME",
                   help="benchmark (repeatable): aime24, aime25, math500, gsm8k, livecodebench (public tests "
                        "only), humaneval, leetcode, synthetic")
    e.add_argument("--samples", type=int, default=1, help="answers per problem (k)")
    e.add_argument("--limit", type=int, help="only the first N problems")
    e.add_argument("--out", help="output folder (default: runs/eval-<time>)")
    e.add_argument("--temperature", type=float, default=0.6)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--max-new-tokens", type=int, help="default: 1024 for math and code, 64 for synthetic")
    e.add_argument("--scheduler", help="Dask scheduler address for grading (default: a local cluster)")
    e.add_argument("--reference", action="store_true",
                   help="grade each problem's own reference solution; prints JSON with 'accuracy' last")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)
