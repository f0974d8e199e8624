"""Prefect flow: train one experiment config (the long-running asynchronous run)."""

from __future__ import annotations

from prefect import flow

from tasks.provision import apply_s3_credentials_block
from tasks.training import train_run


@flow(name="train", log_prints=True)
def train(config_path: str = "configs/quickstart.yaml", run_dir: str = "runs/quickstart",
          max_steps: int | None = None, overrides: dict | None = None, evaluate_every: int | None = 50,
          progress: bool = False, cache_dir: str | None = None, resume: bool = False,
          s3_credentials_block: str | None = None) -> dict:
    """``evaluate_every``: which checkpoints are marked for the evaluate deployment
    (k: every k-th version and the final one; 0: none; None: all). ``resume``: continue the run in
    ``run_dir`` from its latest checkpoint (a retry of the task always does).
    ``s3_credentials_block``: a Prefect Secret block with AWS_* variables (else: the environment)."""
    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    return train_run(config_path, run_dir, max_steps, overrides, evaluate_every, progress, cache_dir, resume)


if __name__ == "__main__":
    train()
