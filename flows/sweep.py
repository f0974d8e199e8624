"""Prefect flow: a grid over eta, objective (and any config key); one training run per point, then a report."""

from __future__ import annotations

import os

from prefect import flow

from areal_core.sweep import default_out_dir, freeze_config, sweep_points, validate_points
from flows.report import report
from flows.train import train


@flow(name="sweep", log_prints=True)
def sweep(config_path: str = "configs/quickstart.yaml", eta: list[int] | None = None,
          objective: list[str] | None = None, grid: dict[str, list] | None = None,
          max_steps: int | None = None, out_dir: str | None = None, overrides: dict | None = None,
          evaluate_every: int | None = 50, make_report: bool = True, cache_dir: str | None = None,
          s3_credentials_block: str | None = None) -> dict:
    """Runs go to ``out_dir/<label>`` one after another (each uses the whole machine);
    the report (report.md, report.csv, plots) to ``out_dir``. The config (with ``overrides``)
    is frozen to ``out_dir/config.yaml`` first: every run uses that copy."""
    points = sweep_points(eta if eta is not None else [0, 4],
                          objective if objective is not None else ["decoupled", "naive"], grid)
    name = validate_points(config_path, points, overrides)  # every point checked before any run starts
    out_dir = out_dir or default_out_dir(name)
    frozen = freeze_config(config_path, os.path.join(out_dir, "config.yaml"), overrides)
    print(f"sweep of {len(points)} runs -> {os.path.abspath(out_dir)}: {[label for label, _ in points]}")
    run_dirs = []
    for label, ov in points:
        run_dir = os.path.join(out_dir, label)
        train.with_options(flow_run_name=f"train-{label}")(
            config_path=frozen, run_dir=run_dir, max_steps=max_steps,
            overrides=ov, evaluate_every=evaluate_every, cache_dir=cache_dir,
            s3_credentials_block=s3_credentials_block)
        run_dirs.append(run_dir)
    report_path = report(run_dirs, out_dir, title=f"sweep {name}") if make_report else None
    return {"out_dir": out_dir, "run_dirs": run_dirs, "report": report_path}


if __name__ == "__main__":
    sweep()
