"""The `areal-flow` commands that evaluate: ``eval`` (``eval_command.py``), ``eval-tools`` (held-out
accuracy with a run's tool-use episode) and ``report`` (finished runs compared)."""

from __future__ import annotations

import json
from pathlib import Path

from flows.cli_input import UsageError, add_command
from flows.eval_command import cmd_eval


def cmd_eval_tools(args) -> int:
    from areal_core.eval.with_tools import evaluate_heldout

    if "://" not in args.run_dir and not Path(args.run_dir, "config.json").is_file():
        raise UsageError(f"not a run folder (no config.json): {args.run_dir}")
    result = evaluate_heldout(args.run_dir, args.version, n_problems=args.n_problems)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from areal_core.storage.fsutil import write_text_atomic

        write_text_atomic(args.out, text + "\n")
    return 0


def cmd_report(args) -> int:
    missing = [r for r in args.runs if "://" not in r and not Path(r, "summary.json").is_file()]
    if missing:
        raise UsageError(f"not a finished run folder (no summary.json): {', '.join(missing)}")
    out = args.out or str(Path(args.runs[0]) / "report")
    if args.no_prefect:
        from areal_core.report.compare import write_report

        print(write_report(args.runs, out, title=args.title)["report"])
    else:
        from flows.report import report
        from infra.command_server import prefect_api

        with prefect_api():
            print(report(run_dirs=args.runs, out_dir=out, title=args.title))
    return 0


def _eval_parser(sub) -> None:
    e = add_command(sub, "eval", "evaluate a checkpoint or model on benchmarks (or --reference self-check)", cmd_eval)
    e.add_argument(
        "model",
        nargs="?",
        metavar="CHECKPOINT_OR_MODEL",
        help="checkpoint version folder/URL, HF model folder, or smollm2-135m",
    )
    e.add_argument(
        "--bench",
        action="append",
        required=True,
        metavar="NAME",
        help="benchmark (repeatable): aime24, aime25, math500, gsm8k, livecodebench (public tests "
        "only), humaneval, leetcode, synthetic, or heldout: the held-out problems of the run the "
        "checkpoint belongs to, sampled as that run measured them",
    )
    e.add_argument("--samples", type=int, default=1, help="answers per problem (k)")
    e.add_argument("--limit", type=int, help="only the first N problems")
    e.add_argument("--out", help="output folder (default: runs/eval-<time>)")
    e.add_argument(
        "--temperature", type=float, help="sampling temperature (default 0.6; heldout: the run's eval.temperature)"
    )
    e.add_argument("--top-p", type=float, help="nucleus sampling mass (default 0.95; heldout: 1.0)")
    e.add_argument(
        "--max-new-tokens", type=int, help="default: 1024 for math and code, 64 for synthetic; heldout: the run's"
    )
    e.add_argument(
        "--run-dir",
        help="the training run the checkpoint belongs to, for --bench heldout (found by itself for RUN/checkpoints/vN)",
    )
    e.add_argument(
        "--scheduler",
        help="Dask scheduler to grade on: tls://host:8786 (with the --tls-* files) or tcp://host:8786 "
        "(default: a local cluster)",
    )
    e.add_argument("--tls-ca-file", help="a tls:// --scheduler: the CA certificate (PEM) its cluster's are signed by")
    e.add_argument("--tls-cert", help="a tls:// --scheduler: this client's certificate (PEM), signed by that CA")
    e.add_argument("--tls-key", help="a tls:// --scheduler: its private key (PEM; default: in --tls-cert)")
    e.add_argument(
        "--reference",
        action="store_true",
        help="grade each problem's own reference solution; prints JSON with 'accuracy' last",
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bars")


def _eval_tools_parser(sub) -> None:
    h = add_command(
        sub,
        "eval-tools",
        "held-out accuracy of a run's checkpoints with its tool-use episode (JSON)",
        cmd_eval_tools,
        description="Held-out accuracy of a run's checkpoints with its episode (the tool-use episode): "
        "on the run's own held-out problems and sampling (greedy unless its eval.temperature says "
        "otherwise), one answer per problem, graded as in training.",
    )
    h.add_argument("run_dir", metavar="RUN_DIR", help="the training run's folder")
    h.add_argument(
        "--version",
        type=int,
        action="append",
        metavar="N",
        help="checkpoint version (repeatable; default: the first and the latest)",
    )
    h.add_argument("--n-problems", type=int, metavar="N", help="only the first N held-out problems")
    h.add_argument("--out", metavar="FILE", help="also write the result here (JSON)")


def _report_parser(sub) -> None:
    r = add_command(sub, "report", "compare finished runs: a table, plots and their checkpoint evaluations", cmd_report)
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run folders (local or s3://)")
    r.add_argument("--out", help="where report.md, report.csv and the plots go (default: FIRST_RUN/report)")
    r.add_argument("--title", default="areal-flow report", help="the report's title")
    r.add_argument("--no-prefect", action="store_true", help="write the report without a Prefect flow run")


def add_evaluate_commands(sub) -> None:
    """evaluate: eval, eval-tools, report."""
    for add in (_eval_parser, _eval_tools_parser, _report_parser):
        add(sub)
