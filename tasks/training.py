"""Prefect task: one training run (a thin wrapper over areal_core.run)."""

from __future__ import annotations

from prefect import task

from areal_core.experiment import load_config
from areal_core.run import run_experiment


@task(name="train", log_prints=True)
def train_run(config_path: str, run_dir: str, max_steps: int | None = None, overrides: dict | None = None) -> dict:
    cfg = load_config(config_path, overrides)
    return run_experiment(cfg, run_dir, max_steps=max_steps, progress=False)
