"""``areal-flow report``, ``serve``, ``runs`` and ``replay``: the tools around training runs."""

from __future__ import annotations

import argparse
import json


def cmd_report(args) -> int:
    from pathlib import Path

    missing = [r for r in args.runs if "://" not in r and not Path(r, "summary.json").is_file()]
    if missing:
        from flows.cli_input import UsageError

        raise UsageError(f"not a finished run folder (no summary.json): {', '.join(missing)}")
    out = args.out or str(Path(args.runs[0]) / "report")
    if args.no_prefect:
        from areal_core.report.compare import write_report

        print(write_report(args.runs, out, title=args.title)["report"])
    else:
        from flows.report import report

        print(report(run_dirs=args.runs, out_dir=out, title=args.title))
    return 0


def cmd_serve(args) -> int:
    from flows.cli_input import _load, _overrides

    overrides = _overrides(args.set)
    cfg = _load(args.config, overrides)
    hold = None if args.hold_s <= 0 else args.hold_s
    if args.no_prefect:
        from areal_core.ops.serve import serve_rollout

        def up(urls: list[str]) -> None:
            print("rollout servers up: " + " ".join(urls), flush=True)

        try:
            out = serve_rollout(cfg, args.model, log_dir=args.log_dir, hold_s=hold, on_up=up)
        except KeyboardInterrupt:
            print("stopped")
            return 130
    else:
        from flows.serve import rollout_servers

        out = rollout_servers(args.model, args.config, overrides=overrides or None, hold_s=hold, log_dir=args.log_dir)
    print(json.dumps(out))
    return 0


def cmd_runs(args) -> int:
    from areal_core.run.folder import runs_root
    from areal_core.run.listing import list_runs

    root = args.root or runs_root()
    try:
        entries = list_runs(root)
    except FileNotFoundError as e:
        from flows.cli_input import UsageError

        raise UsageError(str(e)) from None
    if not entries:
        print(f"no runs under {root}")
        return 0
    rows = [("folder", "config", "state", "steps", "held-out before -> after")]
    rows += [(e.folder, e.name, e.state, e.steps, e.accuracy) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_replay(args) -> int:
    from flows.cli_input import UsageError, _overrides

    overrides = _overrides(args.set)
    if args.no_prefect:
        from areal_core.run.replay import ReplayError, replay

        try:
            summary = replay(
                args.run_dir,
                args.out,
                from_step=args.from_step,
                to_step=args.to_step,
                overrides=overrides,
                threads=args.threads,
                tolerant=args.tolerant,
            )
        except ReplayError as e:
            raise UsageError(str(e)) from None
    else:
        from flows.replay import replay_run

        summary = replay_run(
            args.run_dir,
            args.out,
            from_step=args.from_step,
            to_step=args.to_step,
            overrides=overrides or None,
            threads=args.threads,
            tolerant=args.tolerant,
        )
    r = summary["replay"]
    kind = "counterfactual replay" if r["counterfactual"] else "replay"
    print(
        f"{kind} of {r['of']} steps {r['from_step'] + 1}..{r['to_step']} in {summary['wall_time_s']:.1f} s "
        f"-> {args.out} (replay.png compares loss, grad norm and clip fraction)"
    )
    return 0 if r["counterfactual"] or summary["all_match"] else 1


def add_parsers(sub: argparse._SubParsersAction, add_set) -> None:
    r = sub.add_parser("report", help="compare finished runs: a table, plots and their checkpoint evaluations")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run folders (local or s3://)")
    r.add_argument("--out", help="where report.md, report.csv and the plots go (default: FIRST_RUN/report)")
    r.add_argument("--title", default="areal-flow report", help="the report's title")
    r.add_argument("--no-prefect", action="store_true", help="write the report without a Prefect flow run")
    r.set_defaults(func=cmd_report)

    s = sub.add_parser("serve", help="keep a pool of rollout servers up for runs elsewhere (the rollout-servers flow)")
    s.add_argument("model", help="a checkpoint version folder (RUN/checkpoints/vN) or an HF model folder")
    s.add_argument(
        "--config", default="configs/quickstart.yaml", help="the config whose rollout section the pool follows"
    )
    add_set(s)
    s.add_argument("--hold-s", type=float, default=0.0, help="seconds to keep them up (default 0: until Ctrl-C)")
    s.add_argument("--log-dir", default="runs/rollout-servers", help="where the servers' logs and API key go")
    s.add_argument("--no-prefect", action="store_true", help="serve without a Prefect flow run")
    s.set_defaults(func=cmd_serve)

    n = sub.add_parser(
        "runs",
        help="list the run folders and their state (finished, or unfinished: running, "
        "or stopped at its last checkpoint, which --resume continues from)",
    )
    n.add_argument("root", nargs="?", help="where to look (default: $AREAL_RUNS_DIR or runs/)")
    n.set_defaults(func=cmd_runs)

    p = sub.add_parser(
        "replay",
        help="train a run's recorded steps again from a checkpoint, with no rollout "
        "server: checks every later checkpoint's weights bit for bit, or (--set) trains the same "
        "data under another trainer setting",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the original run's folder")
    p.add_argument("--out", required=True, metavar="OUT_DIR", help="the replay's run folder (new)")
    p.add_argument(
        "--from-step", type=int, default=0, metavar="A", help="start from the run's checkpoint vA (default 0)"
    )
    p.add_argument("--to-step", type=int, metavar="B", help="stop after step B (default: the run's last step)")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="the trainer's torch threads (default: the machine's cores; "
        "the torch trainer's results do not depend on the count, and the hashes say so)",
    )
    p.add_argument(
        "--tolerant",
        action="store_true",
        help="where the weights differ from the original's (e.g. another CPU kind), train on to the last "
        "step and say how far they drift, instead of stopping at the first checkpoint that differs",
    )
    add_set(p)
    p.add_argument("--no-prefect", action="store_true", help="replay without a Prefect flow run")
    p.set_defaults(func=cmd_replay)
