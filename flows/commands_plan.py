"""The `areal-flow` commands of the simulator (docs/PLANNING.md): ``plan`` (a cluster's split and eta),
``calibrate`` (this machine's component costs, fitted), ``calibrate-in-situ`` (what the whole system
adds to them) and ``simulate`` (the calibrated simulator against finished runs)."""

from __future__ import annotations

import json

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WEIGHT_UPDATE_MODES
from flows.cli_input import UsageError, add_command, csv_values, int_list, positive_int

# (the simulator's defaults are filled in when a command runs: building the parser imports no simulator)
QUICKSTART_CALIBRATION = "the quickstart's calibration file in areal_core/sim/data"


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
            answer_lengths=int_list(args.lengths, "--lengths") or None,
            from_run=args.from_run,
            etas=int_list(args.eta, "--eta"),
            ratios=csv_values(args.ratio) or None,
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


def _calibration(path: str | None):
    """The cost model of a calibration file (None: the quickstart's) and the whole file; a missing or
    foreign file is a usage error."""
    from areal_core.sim.measure import DEFAULT_CALIBRATION, load_calibration

    path = path or DEFAULT_CALIBRATION
    try:
        return load_calibration(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{e} (expected the JSON `areal-flow calibrate` writes)") from None


def cmd_calibrate(args) -> int:
    from areal_core.sim.measure import DEFAULT_CALIBRATION, DEFAULT_CONFIG, describe_fit, measure, write_calibration

    result = measure(args.config or DEFAULT_CONFIG, args.quick)
    path = write_calibration(result, args.out or DEFAULT_CALIBRATION)
    print(describe_fit(result))
    print(f"wrote {path}")
    return 0


def cmd_calibrate_in_situ(args) -> int:
    from pathlib import Path

    from areal_core.sim import in_situ
    from areal_core.sim.measure import DEFAULT_CALIBRATION, DEFAULT_CONFIG

    calibration = args.calibration or DEFAULT_CALIBRATION
    cost, _ = _calibration(calibration)
    if args.step == "measure":
        config = args.config or DEFAULT_CONFIG
        sets = list(in_situ.DEFAULT_SETS) if args.set is None else args.set
        batches = int_list(args.batches, "--batches") if args.batches else list(in_situ.DEFAULT_BATCHES)
        steps = args.steps or in_situ.DEFAULT_STEPS
        runs = in_situ.run_calibration(config, sets, batches, steps, Path(args.out_dir))
        meta = {"config": config, "sets": sets, "batches": batches, "steps": steps}
    else:
        runs, meta = args.runs, {}
    try:
        result = {**in_situ.fit(runs, cost), **meta}
    except ValueError as e:  # not a finished run, or no synchronous one among them
        raise UsageError(str(e)) from None
    in_situ.write_fit(calibration, result)
    print(in_situ.format_fit(result))
    print(f"written to {calibration} (section in_situ)")
    return 0


def cmd_simulate(args) -> int:
    from areal_core.sim.local import calibration_notes, format_rows, validate_runs

    cost, data = _calibration(args.calibration)
    in_situ = None if args.components_only else data.get("in_situ")
    try:
        rows = validate_runs(args.runs, cost, args.seeds, in_situ)
    except ValueError as e:  # not a finished run folder
        raise UsageError(str(e)) from None
    print(format_rows(rows))
    for note in calibration_notes(in_situ, args.runs):
        print(note)
    if args.json:
        from areal_core.storage.fsutil import write_text_atomic

        write_text_atomic(args.json, json.dumps(rows, indent=1) + "\n")
    return 0


def _plan_parser(sub) -> None:
    pl = add_command(
        sub, "plan", "recommend a cluster's rollout:trainer split and eta by simulation (docs/PLANNING.md)", cmd_plan
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
        choices=WEIGHT_UPDATE_MODES,
        default=DEFAULT_WEIGHT_UPDATE,
        help=f"what an update does to answers in flight (default {DEFAULT_WEIGHT_UPDATE})",
    )
    pl.add_argument("--steps", type=int, default=30, help="training steps to simulate per alternative (default 30)")
    pl.add_argument("--seed", type=int, default=0, help="seed of the simulated answer lengths")
    pl.add_argument("--out", metavar="DIR", help="also write plan.json and plan_ratio.png (the plot) to DIR")


def _calibrate_parser(sub) -> None:
    c = add_command(
        sub,
        "calibrate",
        "measure this machine's costs (decode, prefill, weight update, train) and fit the simulator to them",
        cmd_calibrate,
        description="Measure this machine's costs with the project's own engine and trainer (the config's model "
        "shape, sampling and trainer settings), and fit the simulator's cost model to them; about 1 min.",
    )
    c.add_argument("--config", help="the config whose model and trainer are timed (default: the quickstart's)")
    c.add_argument("--out", help=f"where to write the calibration JSON (default: {QUICKSTART_CALIBRATION})")
    c.add_argument("--quick", action="store_true", help="one repetition per point (about 4x faster, noisier)")


def _calibrate_in_situ_parser(sub) -> None:
    c = add_command(
        sub,
        "calibrate-in-situ",
        "measure what the whole system adds to the calibrated costs, from short runs, into the calibration file",
        cmd_calibrate_in_situ,
    )
    steps = c.add_subparsers(dest="step", required=True, metavar="STEP", help="measure, or fit")
    m = steps.add_parser("measure", help="make the calibration runs (sync, then async, per batch size) and fit")
    m.add_argument("--config", help="the calibration runs' config (default: the quickstart's)")
    m.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config overrides of the calibration setting (repeatable; default: another seed than the "
        "quickstart's and a small held-out evaluation, areal_core/sim/in_situ.py)",
    )
    m.add_argument(
        "--batches",
        metavar="B1,B2,...",
        help="answers per step of each calibration setting, comma-separated (default: two sizes, one "
        "smaller and one larger than the quickstart's)",
    )
    m.add_argument(
        "--steps",
        type=positive_int,
        help="steps of each run (default: the calibration setting's, areal_core/sim/in_situ.py)",
    )
    m.add_argument("--out-dir", default="runs/sim-calibration", help="where the runs go (runs/sim-calibration)")
    f = steps.add_parser("fit", help="fit from finished run folders (at least one synchronous)")
    f.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run folders")
    for p in (m, f):
        p.add_argument(
            "--calibration", help=f"the file `areal-flow calibrate` wrote (default: {QUICKSTART_CALIBRATION})"
        )


def _simulate_parser(sub) -> None:
    s = add_command(
        sub,
        "simulate",
        "the calibrated simulator against finished runs: their measured and predicted throughput",
        cmd_simulate,
        description="Replay each run's setting (batch, eta, weight-update mode, servers, threads, answer "
        "lengths) in the simulator calibrated on this machine, and compare the predicted answer tokens "
        "trained per second with what the run measured.",
    )
    s.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run folders (areal-flow train --run-dir)")
    s.add_argument("--calibration", help=f"the file `areal-flow calibrate` wrote (default: {QUICKSTART_CALIBRATION})")
    s.add_argument("--seeds", type=int, default=3, help="simulations per run (answer-length draws)")
    s.add_argument("--json", metavar="FILE", help="also write the rows to this JSON file")
    s.add_argument(
        "--components-only",
        action="store_true",
        help="leave out the in-situ overheads even where the calibration file has them",
    )


def add_plan_commands(sub) -> None:
    """plan: plan, calibrate, calibrate-in-situ, simulate."""
    for add in (_plan_parser, _calibrate_parser, _calibrate_in_situ_parser, _simulate_parser):
        add(sub)
