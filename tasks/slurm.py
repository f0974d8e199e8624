"""Prefect task: a run whose trainer is a Slurm job (a thin wrapper over areal_core.cluster.trainer_job).

The task submits the trainer's job, logs its state changes and its log lines, and returns the run's
summary once the job completed; a job that ends otherwise fails the task with one line naming the job,
its state, node and log. A cancelled flow run (SIGTERM to its process) cancels every job of the run.
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger


@task(name="train-on-slurm")
def train_on_slurm(config_path: str, run_dir: str, max_steps: int | None, overrides: dict | None) -> dict:
    from areal_core.cluster.trainer_job import outcome, run_trainer_job, set_args
    from areal_core.experiment import load_config

    logger = get_run_logger()
    cfg = load_config(config_path, {**(overrides or {}), "cluster.kind": "slurm"})
    info = run_trainer_job(cfg, config_path, run_dir, set_args(overrides), max_steps, echo=logger.info)
    return outcome(info, run_dir, f"the train flow with cluster=slurm, run_dir={run_dir}")
