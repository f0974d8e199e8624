"""Prefect flow: train one experiment config."""

from __future__ import annotations

from prefect import flow

from tasks.training import train_run


@flow(name="train")
def train(config_path: str = "configs/quickstart.yaml", run_dir: str = "runs/quickstart",
          max_steps: int | None = None, overrides: dict | None = None) -> dict:
    summary = train_run(config_path, run_dir, max_steps, overrides)
    print(f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
    return summary


if __name__ == "__main__":
    train()
