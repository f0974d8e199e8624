"""The `areal-flow` commands that train: ``train`` (``train_command.py``), ``sweep``, ``campaign`` and
``replay``."""

from __future__ import annotations

import argparse
import sys

from flows.cli_input import (
    UsageError,
    add_command,
    add_set,
    config_from,
    csv_values,
    grid_from,
    overrides_from,
    positive_int,
    settings_from,
)


def cmd_train(args) -> int:
    from flows.train_command import run_train_command

    return run_train_command(args)


def cmd_sweep(args) -> int:
    from areal_core.experiment import ConfigError
    from areal_core.run.sweep import plan_points, validate_configs

    base, grid = overrides_from(args.set), grid_from(args.grid)
    eta = csv_values(args.eta, int) if args.eta is not None else None
    objective = csv_values(args.objective) if args.objective is not None else None
    try:  # every point of every config checked here: a bad one is a usage error, not a failed flow run
        validate_configs(args.config, plan_points(eta, objective, grid, len(args.config)), base)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    from flows.sweep import sweep
    from infra.command_server import prefect_api

    with prefect_api():
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
    overrides = overrides_from(args.set)
    cfg = config_from(args.config, overrides)
    settings = settings_from(args.setting)
    if settings and (args.eta or args.objective or args.grid):
        raise UsageError("--setting names every setting of the campaign: give it without --eta, --objective or --grid")
    for label, ov in settings.items():  # each setting's config, checked before anything runs
        try:
            config_from(args.config, {**overrides, **ov})
        except UsageError as e:
            raise UsageError(f"--setting {label}: {e}") from None
    from areal_core.interrupt import EXIT_STATUS, sigterm_interrupts
    from areal_core.run.campaign import CampaignFolderError
    from areal_core.run.sweep import default_out_dir
    from flows.campaign import campaign
    from infra.command_server import prefect_api

    args.out = args.out or default_out_dir(cfg.name, "campaign")  # named here: a stopped campaign continues there
    try:  # Ctrl-C, or SIGTERM, stops the run it is in; the same command continues
        with sigterm_interrupts(), prefect_api():
            out = run_campaign_command(campaign, args, overrides)
    except CampaignFolderError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        print(
            f"stopped; the same command with --out {args.out} continues the campaign (its finished runs are "
            "reused, the stopped run continues from its latest checkpoint)",
            file=sys.stderr,
        )
        return EXIT_STATUS
    print(f"{out['out_dir']}/decision.md")
    print(out["report"])
    return 0


def run_campaign_command(campaign, args, overrides: dict) -> dict:
    """The campaign flow with the command line's settings."""
    return campaign(
        config_path=args.config,
        out_dir=args.out,
        eta=csv_values(args.eta, int) or None,
        objective=csv_values(args.objective) or None,
        grid=grid_from(args.grid) or None,
        settings=settings_from(args.setting) or None,
        max_steps=args.max_steps,
        overrides=overrides,
        data_source=args.data_source,
        eval_source=args.eval_source,
        benches=csv_values(args.benches) or None,
        eval_limit=args.eval_limit,
        s3_credentials_block=args.s3_credentials_block,
        seeds=args.seeds,
        baseline=args.baseline,
        until_clear=args.until_clear,
        max_seeds=args.max_seeds,
        max_runs=args.max_runs,
        max_minutes=args.max_minutes,
        margin=args.margin,
        outcome=args.outcome,
        keep_run_state=args.keep_run_state,
    )


def cmd_replay(args) -> int:
    overrides = overrides_from(args.set)
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
        from infra.command_server import prefect_api

        with prefect_api():
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


def _train_parser(sub) -> None:
    t = add_command(sub, "train", "run one experiment from a YAML config (a Prefect flow)", cmd_train)
    t.add_argument("config", help="the experiment's YAML config (e.g. configs/quickstart.yaml)")
    t.add_argument("--run-dir", help="output folder (default: runs/<config name>[-<overrides>]-s<seed>-<time>)")
    t.add_argument("--max-steps", type=positive_int, help="override trainer.max_steps")
    add_set(t)
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
    t.add_argument(
        "--cluster",
        choices=("local", "slurm"),
        help="set cluster.kind; slurm: the trainer too runs as a Slurm job (submitted and followed from "
        "here, resumed from its last checkpoint if requeued; the rollout and reward pools are jobs of "
        "their own), docs/how-to/slurm.md",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--json", action="store_true", help="also print the summary as JSON")


def _add_grid(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="another config key to sweep over (repeatable)"
    )


def _sweep_parser(sub) -> None:
    s = add_command(sub, "sweep", "a grid of training runs, then one comparison report (a Prefect flow)", cmd_sweep)
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
    _add_grid(s)
    s.add_argument("--max-steps", type=positive_int, help="override trainer.max_steps for every run")
    s.add_argument("--out", help="output folder (default: runs/sweep-<name>-<time>)")
    add_set(s)
    s.add_argument("--evaluate-every", type=int, default=50, help="see train --evaluate-every")


def _campaign_parser(sub) -> None:
    c = add_command(
        sub, "campaign", "provision, prepare data, train or sweep, evaluate, report (a Prefect flow)", cmd_campaign
    )
    c.add_argument("config", help="the YAML config the campaign trains (or sweeps) with")
    c.add_argument("--out", help="output folder (default: runs/campaign-<name>-<time>)")
    c.add_argument("--eta", default="", help="comma-separated eta values: run a sweep")
    c.add_argument("--objective", default="", help="comma-separated objectives: run a sweep")
    _add_grid(c)
    c.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="LABEL={KEY: VALUE, ...}",
        help="a named setting instead of a grid (repeatable; an ablation's rows), e.g. "
        "bf16-servers='{model.dtype: float32, rollout.dtype: bfloat16}'",
    )
    c.add_argument("--max-steps", type=positive_int, help="override trainer.max_steps")
    add_set(c)
    c.add_argument("--data-source", help="dataset name to train on (default: the config's data)")
    c.add_argument("--eval-source", help="dataset name for held-out accuracy")
    c.add_argument("--benches", default="synthetic", help="comma-separated benchmarks for the final checkpoints")
    c.add_argument("--eval-limit", type=int, help="at most this many problems per benchmark")
    c.add_argument("--s3-credentials-block", help="Prefect Secret block with AWS_* variables")
    c.add_argument(
        "--keep-run-state",
        action="store_true",
        help="keep the optimizer state in finished runs' checkpoints, to continue or replay them (default: "
        "dropped once a run finishes, two thirds of a checkpoint's bytes; the weights stay)",
    )
    d = c.add_argument_group("deciding (paired seeds: seed k runs in every setting)")
    d.add_argument("--seeds", type=positive_int, default=1, help="seeds every setting runs first (default 1)")
    d.add_argument("--baseline", help="the setting differences are taken to, e.g. eta0-decoupled (default: the first)")
    d.add_argument(
        "--until-clear",
        action="store_true",
        help="while a difference to the baseline is unclear (its 95 %% interval neither excludes 0 nor lies "
        "within +-margin), add a seed of the baseline and of each unclear setting, up to --max-seeds / "
        "--max-runs / --max-minutes",
    )
    d.add_argument("--max-seeds", type=positive_int, default=10, help="with --until-clear: seeds per setting at most")
    d.add_argument("--max-runs", type=positive_int, help="with --until-clear: runs in all at most")
    d.add_argument("--max-minutes", type=float, help="with --until-clear: no new seed after this many minutes")
    d.add_argument("--margin", type=float, default=0.02, help="differences within +-margin count as the same")
    d.add_argument(
        "--outcome",
        choices=("accuracy_after", "accuracy_gain"),
        default="accuracy_after",
        help="what decides: held-out accuracy after RL, or its gain",
    )


def _replay_parser(sub) -> None:
    p = add_command(
        sub,
        "replay",
        "train a run's recorded steps again from a checkpoint, with no rollout "
        "server: checks every later checkpoint's weights bit for bit, or (--set) trains the same "
        "data under another trainer setting",
        cmd_replay,
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


def add_run_commands(sub) -> None:
    """run: train, sweep, campaign, replay."""
    for add in (_train_parser, _sweep_parser, _campaign_parser, _replay_parser):
        add(sub)
