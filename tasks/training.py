"""Prefect task: one training run (a thin wrapper over areal_core.run).

Progress: a Prefect progress artifact updated after every step, and a log line every
~5% of the run. Every published checkpoint emits ``areal.checkpoint.published``.
Retries once, and only what a retry can fix (a lost server, storage or network trouble); a
retry resumes from the checkpoints already in object storage. Bad input (config, records, a
refused overwrite, a resume that does not match) fails at once.
"""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from tasks.events import emit_checkpoint_published


def _artifact_key(name: str, run_dir: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{name}-{run_dir.rstrip('/').rsplit('/', 1)[-1]}".lower()).strip("-")
    return f"train-progress-{slug}"[:100]


def worth_retrying(exc: BaseException | None) -> bool:
    """False for errors that fail the same way every time: bad config or records (ValueError and
    its kin), a refused overwrite, a resume state that does not match the config."""
    from areal_core.rollout.weight_transport import TransportUnsupported
    from areal_core.storage.checkpoints import VersionExistsError
    from areal_core.storage.run_state import ResumeError

    return not isinstance(exc, (ValueError, TypeError, KeyError, ImportError, VersionExistsError, ResumeError,
                                TransportUnsupported))


def _retry_condition(task, task_run, state) -> bool:
    return worth_retrying(state.data if isinstance(state.data, BaseException) else None)


@task(name="train-run", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_condition)
def train_run(config_path: str, run_dir: str, max_steps: int | None = None, overrides: dict | None = None,
              evaluate_every: int | None = 50, progress: bool = False, cache_dir: str | None = None,
              resume: bool = False) -> dict:
    from areal_core.experiment import load_config  # torch and transformers: imported when a run starts
    from areal_core.run import run_experiment

    logger = get_run_logger()
    cfg = load_config(config_path, overrides or {})
    total = max_steps or cfg.trainer.max_steps
    ctx = TaskRunContext.get()
    retrying = ctx is not None and ctx.task_run.run_count > 1
    artifact = create_progress_artifact(0.0, key=_artifact_key(cfg.name, run_dir),
                                        description=f"training {cfg.name} -> {run_dir}")
    every = max(1, total // 20)

    def on_step(row: dict) -> None:
        step = row["step"]
        update_progress_artifact(artifact, 100.0 * step / row["total_steps"])
        if step % every == 0 or step == row["total_steps"]:
            logger.info("step %d/%d reward %.3f accuracy %.3f staleness<=%d answer len %.1f tokens/s %.0f",
                        step, row["total_steps"], row["reward"], row["accuracy"], row["staleness_max"],
                        row["answer_len_mean"], row["train_tokens_per_s"])

    def on_checkpoint(version: int, url: str) -> None:
        emit_checkpoint_published(run_dir, cfg.name, version, url, total, evaluate_every)
        logger.debug("checkpoint v%d published: %s", version, url)

    if retrying:  # a retry continues from the checkpoints already in object storage
        logger.warning("retry %d: resuming from the published checkpoints", ctx.task_run.run_count - 1)
    summary = run_experiment(cfg, run_dir, max_steps=max_steps, progress=progress, cache_dir=cache_dir,
                             on_step=on_step, on_checkpoint=on_checkpoint, resume=resume or retrying)
    logger.info("held-out accuracy %.3f -> %.3f, effective throughput %.0f tokens/s, wall %.0f s",
                summary["accuracy_before"], summary["accuracy_after"],
                summary["effective_train_tokens_per_s"], summary["wall_time_s"])
    return summary
