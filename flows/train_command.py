"""`areal-flow train`: one experiment, as a Prefect flow run (or in this process with --no-prefect,
or sent to the `train` deployment with --deployment).

Everything the run needs is checked before it starts (config, records, backend, run folder).
Ctrl-C stops it at a checkpoint (areal_core/interrupt.py) and prints the command that continues it;
the exit status is then 130.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from flows.cli_input import UsageError, config_from, overrides_from


def _check_run(cfg, run_dir: Path, resume: bool) -> None:
    """Before anything starts: the records and backend the run needs, and its folder: one that already
    holds checkpoints is continued only with --resume; --resume says what it will do."""
    from areal_core.run.folder import RunFolderError, check_inputs, check_run_folder

    where = cfg.storage.url or str(run_dir / "checkpoints")
    try:
        check_inputs(cfg)
        latest = check_run_folder(cfg, run_dir, resume)
    except RunFolderError as e:
        raise UsageError(str(e)) from None
    if resume:
        print(
            f"resuming from checkpoint v{latest} in {where}"
            if latest is not None
            else f"nothing to resume in {where}: starting fresh",
            flush=True,
        )


def print_run_summary(s: dict, run_dir: Path) -> None:
    from areal_core.run.summary import summary_rows

    print(f"\nrun: {s['name']}   folder: {run_dir}")
    for measure, value in summary_rows(s):
        print(f"  {measure}: {value}")


def _again(args, run_dir: Path) -> str:
    """The command that runs this training again in the same folder (the same config and overrides)."""
    sets = [x for pair in args.set for x in ("--set", pair)]
    steps = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    cluster = ["--cluster", args.cluster] if args.cluster else []
    return shlex.join(["areal-flow", "train", args.config, "--run-dir", str(run_dir), *sets, *steps, *cluster])


def _train(args, cfg, overrides: dict, run_dir: Path, stop) -> dict | None:
    """The run's summary, or None if it was cancelled (Ctrl-C) at a checkpoint."""
    if args.no_prefect:
        from areal_core.run.setup import run_experiment

        return run_experiment(
            cfg,
            run_dir,
            max_steps=args.max_steps,
            progress=not args.no_progress,
            resume=args.resume,
            on_step=stop.training,
            stop=stop,
        )
    from flows.train import train
    from infra.command_server import prefect_api

    with prefect_api():
        state = train(
            config_path=args.config,
            run_dir=str(run_dir),
            max_steps=args.max_steps,
            overrides=overrides,
            evaluate_every=args.evaluate_every,
            progress=not args.no_progress,
            resume=args.resume,
            return_state=True,
        )
        return None if state.is_cancelled() else state.result()


def run_train_command(args) -> int:
    overrides = overrides_from(args.set)
    if args.cluster:
        overrides["cluster.kind"] = args.cluster
    cfg = config_from(args.config, overrides)
    b = cfg.trainer.backend
    if b.kind == "megatron" and os.environ.get("RANK", "0") != "0":  # a torchrun (or srun) rank other than 0
        from areal_core.trainer.megatron.follower import follow_then_leave

        # Ctrl-C is rank 0's alone: it stops at a checkpoint (which needs this rank), then releases it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow_then_leave(b.tensor_parallel_size)
        return 0
    if args.deployment:
        return _submit_to_deployment(args, overrides)
    # Python's last garbage collection at exit walks every object torch and transformers made: seconds
    # on a busy machine, after the run has stopped everything. Frozen objects are left to the exit.
    atexit.register(gc.freeze)
    from areal_core.interrupt import EXIT_STATUS, CtrlC, sigterm_interrupts
    from areal_core.run.folder import default_run_dir, describe_run
    from areal_core.run.setup import RunStopped

    run_dir = Path(args.run_dir or default_run_dir(describe_run(args.config, overrides, args.max_steps)))
    _check_run(cfg, run_dir, args.resume)
    if args.cluster == "slurm":  # the trainer too is a Slurm job: submitted and followed from here
        return _train_on_slurm(args, cfg, run_dir)
    from areal_core.cluster.trainer_job import pools_cancelled_at_exit

    budget = short = None
    # the first Ctrl-C stops at a checkpoint, a second exits at once; SIGTERM interrupts the run (it continues
    # from its latest checkpoint); Slurm pools are cancelled however it ends
    with CtrlC() as stop, sigterm_interrupts(), pools_cancelled_at_exit(cfg, run_dir):
        try:
            summary = _train(args, cfg, overrides, run_dir, stop)
        except RunStopped as e:
            summary, budget, short = None, e.budget, e.servers_short
        except KeyboardInterrupt:
            summary = None
    if summary is None and short is not None:
        print(
            f"stopped at step {_latest_checkpoint(cfg, run_dir)}: {short}; once enough servers are up, continue "
            f"with {_again(args, run_dir)} --resume",
            file=sys.stderr,
        )
        return EXIT_STATUS
    if summary is None and budget is not None:
        step = _latest_checkpoint(cfg, run_dir)
        print(
            f"stopped at step {step}: cost.budget_usd ({budget:g} USD) spent; continue with "
            f"{_again(args, run_dir)} --resume --set cost.budget_usd=<more>",
            file=sys.stderr,
        )
        return EXIT_STATUS
    if summary is None:
        latest = _latest_checkpoint(cfg, run_dir)
        print(
            f"stopped before the first checkpoint; start again with {_again(args, run_dir)}"
            if latest is None
            else f"stopped at step {latest}; continue with {_again(args, run_dir)} --resume",
            file=sys.stderr,
        )
        return EXIT_STATUS
    print_run_summary(summary, run_dir)
    if args.json:
        print(json.dumps(summary))
    return 0


def _train_on_slurm(args, cfg, run_dir: Path) -> int:
    """Submit the trainer as a Slurm job, follow it (its log, here) and end as it ends."""
    from areal_core.cluster.slurm import PoolNotReady, SlurmError
    from areal_core.cluster.trainer_job import TrainerJobEnded, outcome, run_trainer_job
    from areal_core.interrupt import EXIT_STATUS

    try:
        info = run_trainer_job(cfg, args.config, run_dir, args.set, args.max_steps, echo=lambda t: print(t, flush=True))
        summary = outcome(info, run_dir, _again(args, run_dir))
    except (PoolNotReady, SlurmError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TrainerJobEnded as e:
        print(str(e), file=sys.stderr)
        return EXIT_STATUS if e.stopped else 1
    except KeyboardInterrupt:
        print("interrupted: every Slurm job of the run was cancelled", file=sys.stderr)
        return EXIT_STATUS
    print_run_summary(summary, run_dir)
    if args.json:
        print(json.dumps(summary))
    return 0


def _latest_checkpoint(cfg, run_dir) -> int | None:
    from areal_core.storage import CheckpointStore

    return CheckpointStore.from_config(cfg.storage, str(run_dir)).latest()


def _submit_to_deployment(args, overrides: dict) -> int:
    """Send the run to the Prefect server's `train` deployment (a worker runs it) and follow it."""
    if args.no_prefect:
        raise UsageError("--deployment sends the run to a Prefect worker; it cannot go with --no-prefect")
    from infra.deployments import DeploymentError, submit_and_follow

    params = {
        "config_path": str(Path(args.config).resolve()),
        "max_steps": args.max_steps,
        "overrides": overrides or None,
        "evaluate_every": args.evaluate_every,
        "resume": args.resume,
        "cluster": args.cluster,
    }
    if args.run_dir:
        params["run_dir"] = str(Path(args.run_dir).resolve())
    try:
        return submit_and_follow("train/train", params)
    except DeploymentError as e:
        raise UsageError(str(e)) from None
