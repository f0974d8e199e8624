"""The `areal-flow` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime
from pathlib import Path

import yaml

from areal_core.eval.cli import add_eval_command


def parse_overrides(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` pairs as a dict of dotted keys to YAML-parsed values."""
    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"--set expects KEY=VALUE (e.g. trainer.eta=4), got {p!r}")
        k, v = p.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _default_run_dir(cfg_name: str) -> Path:
    return Path("runs") / f"{cfg_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def print_summary(s: dict, run_dir: Path) -> None:
    lb, la = s["answer_length_before"], s["answer_length_after"]
    print()
    print(f"run: {s['name']}   folder: {run_dir}")
    print(f"  held-out accuracy ({s['n_eval_problems']} problems): "
          f"before RL {s['accuracy_before']:.3f} -> after RL {s['accuracy_after']:.3f} "
          f"({s['accuracy_after'] - s['accuracy_before']:+.3f})")
    print(f"  answer length (tokens)  before: p50 {lb['p50']:.0f}  p90 {lb['p90']:.0f}  max {lb['max']}"
          f"   after: p50 {la['p50']:.0f}  p90 {la['p90']:.0f}  max {la['max']}")
    ta = s["trained_answer_length"]
    print(f"  trained answers (tokens): p50 {ta['p50']:.0f}  p90 {ta['p90']:.0f}  max {ta['max']}")
    print(f"  steps {s['steps']}  eta {s['eta']}  objective {s['objective']}  "
          f"max staleness seen {s['max_staleness_observed']}")
    print(f"  effective training throughput {s['effective_train_tokens_per_s']:.0f} tokens/s   "
          f"RL time {s['rl_time_s']:.0f} s   wall time {s['wall_time_s']:.0f} s")
    print(f"  ledger: {'every trajectory trained exactly once' if s['ledger_check']['ok'] else s['ledger_check']}")


def cmd_train(args) -> int:
    from areal_core.experiment import ConfigError, load_config

    try:
        cfg = load_config(args.config, parse_overrides(args.set))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from areal_core.run import run_experiment

    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(cfg.name)
    summary = run_experiment(cfg, run_dir, max_steps=args.max_steps, progress=not args.no_progress,
                             resume=args.resume)
    print_summary(summary, run_dir)
    if args.json:
        print(json.dumps(summary))
    return 0


def add_train_command(sub) -> None:
    t = sub.add_parser("train", help="run one experiment from a YAML config")
    t.add_argument("config")
    t.add_argument("--run-dir", help="output folder (default: runs/<name>-<time>)")
    t.add_argument("--max-steps", type=int, help="override trainer.max_steps")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set trainer.eta=0 (repeatable)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest checkpoint (see docs/OPERATIONS.md)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--json", action="store_true", help="also print the summary as JSON")
    t.set_defaults(func=cmd_train)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser with the core (Prefect-free) subcommands; flows/cli.py adds the rest."""
    p = argparse.ArgumentParser(prog="areal-flow", description="Fully asynchronous RL for LLM reasoning.")
    sub = p.add_subparsers(dest="command", required=True)
    add_train_command(sub)
    add_eval_command(sub)
    return p, sub


def run_parsed(p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    p, _ = build_parser()
    return run_parsed(p, argv)


if __name__ == "__main__":
    sys.exit(main())
