"""Prefect flow: a grid over eta, objective (and any config key); one training run per point, then a report."""

from __future__ import annotations

import os

from prefect import flow

from areal_core.sweep import default_out_dir, freeze_config, plan_points, validate_configs
from flows.report import report
from flows.train import train


@flow(name="sweep", log_prints=True)
def sweep(config_path: str | list[str] = "configs/quickstart.yaml", eta: list[int] | None = None,
          objective: list[str] | None = None, grid: dict[str, list] | None = None,
          max_steps: int | None = None, out_dir: str | None = None, overrides: dict | None = None,
          evaluate_every: int | None = 50, make_report: bool = True, cache_dir: str | None = None,
          s3_credentials_block: str | None = None) -> dict:
    """Runs go to ``out_dir/<label>`` one after another (each uses the whole machine);
    the report (report.md, report.csv, plots) to ``out_dir``. The config (with ``overrides``)
    is frozen to ``out_dir/config.yaml`` first: every run uses that copy.

    Several configs (a list): the grid runs on each, frozen to ``out_dir/config-<name>.yaml``,
    labels ``<name>-<point>`` (the config's ``name``), one report over all; with no grid axis
    given, one run per config."""
    paths = [config_path] if isinstance(config_path, str) else list(config_path)
    several = len(paths) > 1
    points = plan_points(eta, objective, grid, len(paths))
    # every point of every config checked before any run starts
    names = validate_configs(paths, points, overrides)
    out_dir = out_dir or default_out_dir("+".join(names))
    runs = []  # (label, frozen config, overrides)
    for path, name in zip(paths, names, strict=True):
        frozen = freeze_config(path, os.path.join(out_dir, f"config-{name}.yaml" if several else "config.yaml"),
                               overrides)
        runs += [("-".join(x for x in (name if several else "", label) if x), frozen, ov) for label, ov in points]
    print(f"sweep of {len(runs)} runs -> {os.path.abspath(out_dir)}: {[label for label, _, _ in runs]}")
    run_dirs = []
    for label, frozen, ov in runs:
        run_dir = os.path.join(out_dir, label)
        train.with_options(flow_run_name=f"train-{label}")(
            config_path=frozen, run_dir=run_dir, max_steps=max_steps,
            overrides=ov, evaluate_every=evaluate_every, cache_dir=cache_dir,
            s3_credentials_block=s3_credentials_block)
        run_dirs.append(run_dir)
    report_path = report(run_dirs, out_dir, title=f"sweep {' + '.join(names)}") if make_report else None
    return {"out_dir": out_dir, "run_dirs": run_dirs, "report": report_path}


if __name__ == "__main__":
    sweep()
