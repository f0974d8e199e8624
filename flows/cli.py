"""The `areal-flow` command: train, eval, export, sweep, campaign, stack, plan, and runs, report, serve
(``tool_commands.py``); ``train`` itself is ``train_command.py``, ``eval`` ``eval_command.py``.

`train` runs as a Prefect flow (reported to the server at PREFECT_API_URL when set, see
`areal-flow stack up`, else to Prefect's ephemeral server); `train --no-prefect` runs the same
experiment in this process without importing Prefect (a node with no Prefect server, the
resume test). `eval` needs no Prefect either. Config errors end in one `error: ...` line, rc 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect is imported
# Prefect's 20 s for its ephemeral server to start is too short on a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from flows.cli_input import UsageError, _load, _overrides
from flows.eval_command import cmd_eval


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _csv(text: str, kind=str) -> list:
    return [kind(v) for v in text.split(",") if v.strip() != ""]


def _grid(pairs: list[str]) -> dict[str, list]:
    import yaml

    out = {}
    for p in pairs:
        if "=" not in p:
            raise UsageError(f"--grid expects KEY=V1,V2 (e.g. trainer.optim.lr=1e-4,3e-5), got {p!r}")
        k, v = p.split("=", 1)
        out[k] = [yaml.safe_load(x) for x in v.split(",")]
    return out


def cmd_train(args) -> int:
    from flows.train_command import run_train_command

    return run_train_command(args)


def cmd_export(args) -> int:
    from areal_core.trainer.export import ExportError, export_checkpoint

    try:
        print(export_checkpoint(args.source, args.out))
    except ExportError as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_sweep(args) -> int:
    from areal_core.experiment import ConfigError
    from areal_core.run.sweep import plan_points, validate_configs

    base, grid = _overrides(args.set), _grid(args.grid)
    eta = _csv(args.eta, int) if args.eta is not None else None
    objective = _csv(args.objective) if args.objective is not None else None
    try:  # every point of every config checked here: a bad one is a usage error, not a failed flow run
        validate_configs(args.config, plan_points(eta, objective, grid, len(args.config)), base)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    from flows.sweep import sweep

    out = sweep(
        config_path=args.config[0] if len(args.config) == 1 else args.config,
        eta=eta,
        objective=objective,
        grid=grid or None,
        max_steps=args.max_steps,
        out_dir=args.out,
        overrides=base,
        evaluate_every=args.evaluate_every,
    )
    print(out["report"])  # the last line: the report's path
    return 0


def cmd_campaign(args) -> int:
    overrides = _overrides(args.set)
    _load(args.config, overrides)
    from flows.campaign import campaign

    out = campaign(
        config_path=args.config,
        out_dir=args.out,
        eta=_csv(args.eta, int) or None,
        objective=_csv(args.objective) or None,
        grid=_grid(args.grid) or None,
        max_steps=args.max_steps,
        overrides=overrides,
        data_source=args.data_source,
        eval_source=args.eval_source,
        benches=_csv(args.benches) or None,
        eval_limit=args.eval_limit,
        s3_credentials_block=args.s3_credentials_block,
    )
    print(out["report"])
    return 0


def cmd_stack(args) -> int:
    from infra import stack

    return stack.main([args.action] + (["--port", str(args.port)] if args.port else []))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return _csv(text, int)
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated whole numbers, got {text!r}") from None


def cmd_plan(args) -> int:
    from areal_core.sim.request import build_request, run_plan

    try:
        req = build_request(
            model=args.model,
            gpu=args.gpu_type,
            n_gpus=args.gpus,
            context=args.context,
            prompt_tokens=args.prompt_tokens,
            answer_median=args.answer_median,
            answer_sigma=args.answer_sigma,
            answer_lengths=_int_list(args.lengths, "--lengths") or None,
            from_run=args.from_run,
            etas=_int_list(args.eta, "--eta"),
            ratios=_csv(args.ratio) or None,
            prompts_per_step=args.prompts_per_step,
            answers_per_prompt=args.answers_per_prompt,
            weight_update=args.weight_update,
            n_steps=args.steps,
            seed=args.seed,
        )
        outcome = run_plan(req, args.out)
    except ValueError as e:  # every bad input names its argument (areal_core/sim/request.py)
        raise UsageError(str(e)) from None
    print(outcome.markdown)
    for path in outcome.files.values():
        print(f"wrote {path}")
    return 0


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.eta=0 (repeatable)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("areal-flow")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="areal-flow", description="Fully asynchronous RL for LLM reasoning.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run one experiment from a YAML config (a Prefect flow)")
    t.add_argument("config", help="the experiment's YAML config (e.g. configs/quickstart.yaml)")
    t.add_argument("--run-dir", help="output folder (default: runs/<config name>[-<overrides>]-s<seed>-<time>)")
    t.add_argument("--max-steps", type=_positive_int, help="override trainer.max_steps")
    _add_set(t)
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its latest checkpoint (see docs/OPERATIONS.md)",
    )
    t.add_argument(
        "--evaluate-every",
        type=int,
        default=50,
        help="mark every k-th checkpoint (and the last) for the evaluate deployment; 0: none",
    )
    t.add_argument(
        "--no-prefect",
        action="store_true",
        help="run in this process without Prefect (no flow run, no events; --evaluate-every unused)",
    )
    t.add_argument(
        "--deployment",
        action="store_true",
        help="send the run to the Prefect server's `train` deployment (PREFECT_API_URL; a worker runs "
        "it and it shows under the deployment's runs) and follow it there",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--json", action="store_true", help="also print the summary as JSON")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint or model on benchmarks (or --reference self-check)")
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
    e.add_argument("--scheduler", help="Dask scheduler address for grading (default: a local cluster)")
    e.add_argument(
        "--reference",
        action="store_true",
        help="grade each problem's own reference solution; prints JSON with 'accuracy' last",
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="write a checkpoint as a plain HF model folder (full weights; LoRA merged)")
    x.add_argument(
        "source",
        metavar="SOURCE",
        help="a checkpoint version (RUN/checkpoints/vN, folder or URL) or a run folder (its latest)",
    )
    x.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    x.set_defaults(func=cmd_export)

    s = sub.add_parser("sweep", help="a grid of training runs, then one comparison report (a Prefect flow)")
    s.add_argument(
        "config",
        nargs="+",
        help="the base YAML config every run of the grid starts from; several: the grid runs on "
        "each (without --eta/--objective/--grid, one run per config as it is), one report",
    )
    s.add_argument("--eta", help="comma-separated max staleness values (default 0,4; several configs: their own)")
    s.add_argument(
        "--objective", help="comma-separated objectives (default decoupled,naive; several configs: their own)"
    )
    s.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="another config key to sweep over (repeatable)"
    )
    s.add_argument("--max-steps", type=_positive_int, help="override trainer.max_steps for every run")
    s.add_argument("--out", help="output folder (default: runs/sweep-<name>-<time>)")
    _add_set(s)
    s.add_argument("--evaluate-every", type=int, default=50, help="see train --evaluate-every")
    s.set_defaults(func=cmd_sweep)

    c = sub.add_parser("campaign", help="provision, prepare data, train or sweep, evaluate, report (a Prefect flow)")
    c.add_argument("config", help="the YAML config the campaign trains (or sweeps) with")
    c.add_argument("--out", help="output folder (default: runs/campaign-<name>-<time>)")
    c.add_argument("--eta", default="", help="comma-separated eta values: run a sweep")
    c.add_argument("--objective", default="", help="comma-separated objectives: run a sweep")
    c.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="another config key to sweep over (repeatable)"
    )
    c.add_argument("--max-steps", type=_positive_int, help="override trainer.max_steps")
    _add_set(c)
    c.add_argument("--data-source", help="dataset name to train on (default: the config's data)")
    c.add_argument("--eval-source", help="dataset name for held-out accuracy")
    c.add_argument("--benches", default="synthetic", help="comma-separated benchmarks for the final checkpoints")
    c.add_argument("--eval-limit", type=int, help="at most this many problems per benchmark")
    c.add_argument("--s3-credentials-block", help="Prefect Secret block with AWS_* variables")
    c.set_defaults(func=cmd_campaign)

    pl = sub.add_parser(
        "plan", help="recommend a cluster's rollout:trainer split and eta by simulation (docs/PLANNING.md)"
    )
    pl.add_argument(
        "--model",
        default="7B",
        help="model size: 1.5B, 7B or 32B, or a name that carries one (e.g. DeepSeek-R1-Distill-Qwen-7B)",
    )
    pl.add_argument("--gpus", type=int, default=64, help="GPUs in all (default 64)")
    pl.add_argument("--gpu-type", default="H800", help="H800, H100, A100 or H200 (default H800)")
    pl.add_argument("--context", type=int, default=16384, help="context length: prompt + answer tokens (default 16384)")
    pl.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length in tokens (default 1024)")
    pl.add_argument(
        "--answer-median",
        type=float,
        default=4000.0,
        help="median answer length of the lognormal answer-length distribution (default 4000)",
    )
    pl.add_argument(
        "--answer-sigma",
        type=float,
        default=0.9,
        help="log-space standard deviation of that lognormal (default 0.9; 0: every answer the median)",
    )
    pl.add_argument(
        "--lengths",
        default="",
        metavar="L1,L2,...",
        help="answer lengths to draw from instead of the lognormal (comma-separated tokens)",
    )
    pl.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        help="draw answer lengths from a past run: its ledger.parquet, else its metrics.parquet",
    )
    pl.add_argument("--eta", default="1,2,4,8", help="comma-separated staleness bounds to try (default 1,2,4,8)")
    pl.add_argument(
        "--ratio",
        default="",
        metavar="R:T,...",
        help="rollout:trainer splits to try, e.g. 1:1,3:1,7:1 (default: 3/8 to 7/8 of the GPUs)",
    )
    pl.add_argument("--prompts-per-step", type=int, default=128, help="prompts per training batch (default 128)")
    pl.add_argument("--answers-per-prompt", type=int, default=16, help="answers per prompt (default 16)")
    pl.add_argument(
        "--weight-update",
        default="reprefill",
        help="what an update does to answers in flight: reprefill, keep_kv or drain (default reprefill)",
    )
    pl.add_argument("--steps", type=int, default=30, help="training steps to simulate per alternative (default 30)")
    pl.add_argument("--seed", type=int, default=0, help="seed of the simulated answer lengths")
    pl.add_argument("--out", metavar="DIR", help="also write plan.json and plan_ratio.png (the plot) to DIR")
    pl.set_defaults(func=cmd_plan)

    k = sub.add_parser("stack", help="the local Prefect server + worker with the deployments")
    k.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start the server, a worker and the deployments; down: stop them; status: show them",
    )
    k.add_argument("--port", type=int, help="server port for `up` (default 4200, or a free one if taken)")
    k.set_defaults(func=cmd_stack)

    from flows.tool_commands import add_parsers

    add_parsers(sub, _add_set)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
