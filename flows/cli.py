"""The `areal-flow` command: the core commands, run as Prefect flows, plus campaign, sweep and stack.

Flows report to the Prefect server at PREFECT_API_URL when it is set (see `areal-flow stack up`),
otherwise to Prefect's ephemeral server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect is imported
# Prefect's 20 s for its ephemeral server to start is too short on a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from areal_core.cli import _default_run_dir, build_parser, parse_overrides, print_summary, run_parsed  # noqa: E402


def _csv(text: str, kind=str) -> list:
    return [kind(v) for v in text.split(",") if v.strip() != ""]


def _grid(pairs: list[str]) -> dict[str, list]:
    import yaml

    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"--grid expects KEY=V1,V2 (e.g. trainer.optim.lr=1e-4,3e-5), got {p!r}")
        k, v = p.split("=", 1)
        out[k] = [yaml.safe_load(x) for x in v.split(",")]
    return out


def _config_error(config: str, overrides: dict) -> int | None:
    from areal_core.experiment import ConfigError, load_config

    try:
        load_config(config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return None


def cmd_train(args) -> int:
    overrides = parse_overrides(args.set)
    if (rc := _config_error(args.config, overrides)) is not None:
        return rc
    from areal_core.experiment import load_config
    from flows.train import train

    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(load_config(args.config, overrides).name)
    summary = train(config_path=args.config, run_dir=str(run_dir), max_steps=args.max_steps, overrides=overrides,
                    evaluate_every=args.evaluate_every, progress=not args.no_progress, resume=args.resume)
    print_summary(summary, run_dir)
    if args.json:
        import json

        print(json.dumps(summary))
    return 0


def cmd_sweep(args) -> int:
    from areal_core.experiment import ConfigError
    from areal_core.sweep import sweep_points, validate_points

    base = parse_overrides(args.set)
    try:
        points = sweep_points(_csv(args.eta, int), _csv(args.objective), _grid(args.grid))
        validate_points(args.config, points, base)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flows.sweep import sweep

    out = sweep(config_path=args.config, eta=_csv(args.eta, int), objective=_csv(args.objective),
                grid=_grid(args.grid) or None, max_steps=args.max_steps, out_dir=args.out, overrides=base,
                evaluate_every=args.evaluate_every)
    print(out["report"])  # the last line: the report's path
    return 0


def cmd_campaign(args) -> int:
    overrides = parse_overrides(args.set)
    if (rc := _config_error(args.config, overrides)) is not None:
        return rc
    from flows.campaign import campaign

    out = campaign(config_path=args.config, out_dir=args.out, eta=_csv(args.eta, int) or None,
                   objective=_csv(args.objective) or None, grid=_grid(args.grid) or None,
                   max_steps=args.max_steps, overrides=overrides, data_source=args.data_source,
                   eval_source=args.eval_source, benches=_csv(args.benches) or None, eval_limit=args.eval_limit,
                   s3_credentials_block=args.s3_credentials_block)
    print(out["report"])
    return 0


def cmd_stack(args) -> int:
    from infra import stack

    return stack.main([args.action] + (["--port", str(args.port)] if args.port else []))


def main(argv: list[str] | None = None) -> int:
    p, sub = build_parser()
    t = sub.choices["train"]
    t.add_argument("--evaluate-every", type=int, default=50,
                   help="mark every k-th checkpoint (and the last) for the evaluate deployment; 0: none")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("sweep", help="a grid of training runs, then one comparison report (a Prefect flow)")
    s.add_argument("config")
    s.add_argument("--eta", default="0,4", help="comma-separated max staleness values (default 0,4)")
    s.add_argument("--objective", default="decoupled,naive", help="comma-separated objectives")
    s.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="another config key to sweep over (repeatable)")
    s.add_argument("--max-steps", type=int, help="override trainer.max_steps for every run")
    s.add_argument("--out", help="output folder (default: runs/sweep-<name>-<time>)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    s.add_argument("--evaluate-every", type=int, default=50, help="see train --evaluate-every")
    s.set_defaults(func=cmd_sweep)

    c = sub.add_parser("campaign", help="provision, prepare data, train or sweep, evaluate, report (a Prefect flow)")
    c.add_argument("config")
    c.add_argument("--out", help="output folder (default: runs/campaign-<name>-<time>)")
    c.add_argument("--eta", default="", help="comma-separated eta values: run a sweep")
    c.add_argument("--objective", default="", help="comma-separated objectives: run a sweep")
    c.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2")
    c.add_argument("--max-steps", type=int)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--data-source", help="dataset name to train on (default: the config's data)")
    c.add_argument("--eval-source", help="dataset name for held-out accuracy")
    c.add_argument("--benches", default="synthetic", help="comma-separated benchmarks for the final checkpoints")
    c.add_argument("--eval-limit", type=int, help="at most this many problems per benchmark")
    c.add_argument("--s3-credentials-block", help="Prefect Secret block with AWS_* variables")
    c.set_defaults(func=cmd_campaign)

    k = sub.add_parser("stack", help="the local Prefect server + worker with the deployments")
    k.add_argument("action", choices=["up", "down", "status"])
    k.add_argument("--port", type=int, help="server port for `up` (default: a free one)")
    k.set_defaults(func=cmd_stack)
    return run_parsed(p, argv)


if __name__ == "__main__":
    sys.exit(main())
