"""Prefect flow: a grid over eta, objective (and any config key); one training run per point, then a report."""

from __future__ import annotations

import os

from prefect import flow

from areal_core.run.sweep import default_out_dir, freeze_config, plan_points, validate_configs
from flows.report import report
from flows.train import train
from tasks.flow_runs import sweep_run_name


@flow(name="sweep", log_prints=True, flow_run_name=sweep_run_name)
def sweep(
    config_path: str | list[str] = "configs/quickstart.yaml",
    eta: list[int] | None = None,
    objective: list[str] | None = None,
    grid: dict[str, list] | None = None,
    max_steps: int | None = None,
    out_dir: str | None = None,
    overrides: dict | None = None,
    evaluate_every: int | None = 50,
    make_report: bool = True,
    cache_dir: str | None = None,
    s3_credentials_block: str | None = None,
) -> dict:
    """A grid of training runs, one after another (each uses the whole machine), then one report.

    The config (with ``overrides``) is frozen to ``out_dir/config.yaml`` first: every run uses that
    copy. Runs go to ``out_dir/<label>`` (e.g. ``eta0-decoupled``); the report (report.md,
    report.csv, plots) to ``out_dir``, and to this flow run's Artifacts tab.

    Args:
        config_path: The base YAML config (e.g. configs/quickstart.yaml), or a list of configs:
            the grid then runs on each (labels <name>-<point>, one report over all; with no grid
            axis given, one run per config).
        eta: Staleness bounds to sweep, e.g. [0, 4] (0: synchronous). None: the config's.
        objective: Objectives to sweep, e.g. ["decoupled", "naive"]. None: the config's.
        grid: Any other config keys to sweep, dotted, each with its values, as JSON, e.g.
            {"trainer.optim.lr": [1e-4, 3e-5]}.
        max_steps: RL steps of every run. None: the config's trainer.max_steps.
        out_dir: The sweep's folder. None: runs/sweep-<name>-<date>-<time>.
        overrides: Config keys to change in every run, dotted, as JSON, e.g. {"seed": 1}.
        evaluate_every: Which checkpoints the evaluate deployment scores: k = every k-th version and
            the last; 0 = none; None = all.
        make_report: Write the comparison report once every run is done.
        cache_dir: Where warm starts are cached. None: ~/.cache/areal-flow.
        s3_credentials_block: A Prefect Secret block holding AWS_* variables for s3:// storage.
            None: the worker's environment.
    """
    paths = [config_path] if isinstance(config_path, str) else list(config_path)
    several = len(paths) > 1
    points = plan_points(eta, objective, grid, len(paths))
    # every point of every config checked before any run starts
    names = validate_configs(paths, points, overrides)
    out_dir = out_dir or default_out_dir("+".join(names))
    runs = []  # (label, frozen config, overrides)
    for path, name in zip(paths, names, strict=True):
        frozen = freeze_config(
            path, os.path.join(out_dir, f"config-{name}.yaml" if several else "config.yaml"), overrides
        )
        runs += [("-".join(x for x in (name if several else "", label) if x), frozen, ov) for label, ov in points]
    print(f"sweep of {len(runs)} runs -> {os.path.abspath(out_dir)}: {[label for label, _, _ in runs]}")
    run_dirs = []
    for label, frozen, ov in runs:
        run_dir = os.path.join(out_dir, label)
        train.with_options(flow_run_name=f"train-{label}")(
            config_path=frozen,
            run_dir=run_dir,
            max_steps=max_steps,
            overrides=ov,
            evaluate_every=evaluate_every,
            cache_dir=cache_dir,
            s3_credentials_block=s3_credentials_block,
        )
        run_dirs.append(run_dir)
    report_path = report(run_dirs, out_dir, title=f"sweep {' + '.join(names)}") if make_report else None
    return {"out_dir": out_dir, "run_dirs": run_dirs, "report": report_path}
