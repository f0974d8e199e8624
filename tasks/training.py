"""Prefect task: one training run (a thin wrapper over areal_core.run.setup).

What the run shows in the UI, keyed by its run folder's name:
* ``train-progress-<run>``: a progress artifact, updated after every step (and a log line every
  ~5% of the run);
* ``train-curves-<run>``: the learning curves as a plot, redrawn at each checkpoint;
* ``train-result-<run>``: the run's result table, and a link to each evaluation its checkpoints
  triggered (filled in as the evaluate deployment scores them).

Every published checkpoint emits ``areal.checkpoint.published``. Retries once, and only what a
retry can fix (a lost server, storage or network trouble); a retry resumes from the checkpoints
already in object storage. Bad input (config, records, a refused overwrite, a resume that does not
match) fails at once. A Ctrl-C in the terminal that runs it (``areal-flow train``) ends the task
Cancelled, at a checkpoint that ``resume`` continues from.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from tasks.evaluation import evaluation_lines
from tasks.events import emit_checkpoint_published
from tasks.flow_runs import artifact_key, update_markdown

CURVES_MIN_INTERVAL_S = 10.0  # checkpoints closer together than this redraw the curves once


def result_markdown(s: dict, run_dir: str, evaluate_every: int | None) -> str:
    """The run's result (what `train` prints) and the evaluations its checkpoints triggered."""
    from areal_core.report.ui import md_table
    from areal_core.run.summary import summary_rows

    rows = [*summary_rows(s), ("run folder", f"`{run_dir}`")]
    return "\n".join(
        [
            f"### {s['name']}: held-out accuracy {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}",
            "",
            md_table(("measure", "value"), rows),
            "",
            "### Checkpoint evaluations",
            "",
            *evaluation_lines(run_dir, s["checkpoints"], s["final_version"], evaluate_every),
        ]
    )


class Curves:
    """The learning-curves artifact of one run: the steps so far, drawn at checkpoints."""

    def __init__(self, name: str, run_dir: str, total_steps: int, store):
        self.name, self.run_dir, self.total, self.store = name, run_dir, total_steps, store
        self.rows: list[dict] = []
        self.heldout: dict[int, float] = {}
        self.artifact_id = None
        self._drawn_at = -CURVES_MIN_INTERVAL_S

    def checkpoint(self, version: int, final: bool = False) -> None:
        """Checkpoint ``version`` is published: it holds the accuracy before RL (from v1 on)."""
        from areal_core.report.ui import heldout_from_checkpoint

        if 0 not in self.heldout and version > 0:
            before = heldout_from_checkpoint(self.store, version)
            if before is not None:
                self.heldout[0] = before
        self.draw(force=final)

    def draw(self, force: bool = False) -> None:
        from areal_core.report.ui import run_evaluations, training_markdown

        if not self.rows or (not force and time.monotonic() - self._drawn_at < CURVES_MIN_INTERVAL_S):
            return
        md = training_markdown(
            self.name, self.run_dir, self.rows, self.heldout, run_evaluations(self.run_dir), self.total
        )
        if self.artifact_id is None:
            self.artifact_id = create_markdown_artifact(
                md,
                key=artifact_key("train-curves", self.run_dir),
                description=f"learning curves: {self.name} -> {self.run_dir}",
            )
        else:
            update_markdown(self.artifact_id, md)
        self._drawn_at = time.monotonic()


def worth_retrying(exc: BaseException | None) -> bool:
    """False for errors that fail the same way every time: bad config or records (ValueError and
    its kin), a refused overwrite, a resume state that does not match the config; and a stop asked for."""
    from areal_core.rollout.weight_transport import TransportUnsupported
    from areal_core.run.setup import RunStopped
    from areal_core.storage.checkpoints import VersionExistsError
    from areal_core.storage.run_state import ResumeError

    return not isinstance(
        exc,
        (
            ValueError,
            TypeError,
            KeyError,
            ImportError,
            VersionExistsError,
            ResumeError,
            TransportUnsupported,
            RunStopped,
        ),
    )


def _retry_condition(task, task_run, state) -> bool:
    return worth_retrying(state.data if isinstance(state.data, BaseException) else None)


@task(name="train-run", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_condition)
def train_run(
    config_path: str,
    run_dir: str,
    max_steps: int | None = None,
    overrides: dict | None = None,
    evaluate_every: int | None = 50,
    progress: bool = False,
    cache_dir: str | None = None,
    resume: bool = False,
) -> dict:
    from areal_core import interrupt
    from areal_core.controller.prompt_sampling import describe_mix
    from areal_core.experiment import load_config  # torch and transformers: imported when a run starts
    from areal_core.run.setup import RunStopped, run_experiment
    from areal_core.storage import CheckpointStore

    logger = get_run_logger()
    cfg = load_config(config_path, overrides or {})
    total = max_steps or cfg.trainer.max_steps
    ctx = TaskRunContext.get()
    retrying = ctx is not None and ctx.task_run.run_count > 1
    progress_id = create_progress_artifact(
        0.0, key=artifact_key("train-progress", run_dir), description=f"training {cfg.name} -> {run_dir}"
    )
    curves = Curves(cfg.name, str(run_dir), total, CheckpointStore.from_config(cfg.storage, str(run_dir)))
    stop = interrupt.current()  # Ctrl-C, when `areal-flow train` runs this task in its own process
    every = max(1, total // 20)

    def on_step(row: dict) -> None:
        step = row["step"]
        curves.rows.append(row)
        if stop is not None:
            stop.training()
        update_progress_artifact(progress_id, 100.0 * step / row["total_steps"])
        if step % every == 0 or step == row["total_steps"]:
            mix = {k[len("mix_") :]: v for k, v in row.items() if k.startswith("mix_")}
            acc = (
                f"accuracy {row['accuracy']:.3f}"
                if not mix
                # the curriculum draws harder prompts
                else f"accuracy on the curriculum's prompts {row['accuracy']:.3f} "
                f"(next draws: {describe_mix(mix, cfg.data.curriculum.by)})"
            )
            logger.info(
                "step %d/%d reward %.3f %s staleness<=%d answer len %.1f tokens/s %.0f",
                step,
                row["total_steps"],
                row["reward"],
                acc,
                row["staleness_max"],
                row["answer_len_mean"],
                row["train_tokens_per_s"],
            )

    def on_checkpoint(version: int, url: str) -> None:
        emit_checkpoint_published(run_dir, cfg.name, version, url, total, evaluate_every)
        logger.debug("checkpoint v%d published: %s", version, url)
        curves.checkpoint(version, final=version == total)

    if retrying:  # a retry continues from the checkpoints already in object storage
        logger.warning("retry %d: resuming from the published checkpoints", ctx.task_run.run_count - 1)
    try:
        summary = run_experiment(
            cfg,
            run_dir,
            max_steps=max_steps,
            progress=progress,
            cache_dir=cache_dir,
            on_step=on_step,
            on_checkpoint=on_checkpoint,
            resume=resume or retrying,
            stop=stop,
        )
    except RunStopped as e:
        from prefect.states import Cancelled

        curves.draw(force=True)
        return Cancelled(message=f"{e}: resume continues from there")
    logger.info(
        "held-out accuracy %.3f -> %.3f, effective throughput %.0f tokens/s, wall %.0f s",
        summary["accuracy_before"],
        summary["accuracy_after"],
        summary["effective_train_tokens_per_s"],
        summary["wall_time_s"],
    )
    curves.heldout.update({0: summary["accuracy_before"], summary["steps"]: summary["accuracy_after"]})
    curves.draw(force=True)
    create_markdown_artifact(
        result_markdown(summary, str(run_dir), evaluate_every),
        key=artifact_key("train-result", run_dir),
        description=f"result of training {cfg.name} -> {run_dir}",
    )
    if "cost" in summary and (Path(run_dir) / "costs.parquet").is_file():  # (absent with no step trained)
        create_markdown_artifact(
            costs_markdown(summary, run_dir),
            key=artifact_key("train-costs", run_dir),
            description=f"where the time of {cfg.name} went (cost ledger)",
        )
    return summary


def costs_markdown(s: dict, run_dir) -> str:
    """The cost ledger's artifact: each pool's stages per step (stacked) and the totals."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from areal_core.report.ui import md_image, md_table, png_bytes
    from areal_core.run.costs import describe, plot

    fig = plot(pd.read_parquet(Path(run_dir) / "costs.parquet"))
    image = md_image("seconds per step by stage", png_bytes(fig))
    plt.close(fig)
    c = s["cost"]
    rows = [(f"{pool} {k}", f"{v:.1f} s") for pool in ("trainer", "rollout") for k, v in c[f"{pool}_s"].items()]
    rows += [(f"phase {k}", f"{v:.1f} s") for k, v in c["phases_s"].items()]
    rows += [(f"tokens {k}", str(v)) for k, v in c["tokens"].items()]
    if c["usd"] is not None:
        rows.append(("USD (wall time x devices x price)", f"{c['usd']:.2f}"))
    return "\n".join([f"### {s['name']}: {describe(c)}", "", image, "", md_table(("measure", "value"), rows)])
