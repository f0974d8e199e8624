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
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from tasks.evaluation import evaluation_key, evaluation_name
from tasks.events import emit_checkpoint_published, should_evaluate


def _artifact_key(name: str, run_dir: str, what: str = "progress") -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{name}-{run_dir.rstrip('/').rsplit('/', 1)[-1]}".lower()).strip("-")
    return f"train-{what}-{slug}"[:100]


def result_markdown(s: dict, run_dir: str, evaluate_every: int | None, ui_url: str = "") -> str:
    """The run's result (what `train` prints) and links to the evaluations its checkpoints triggered."""
    from areal_core.storage import CheckpointStore

    gain = s["accuracy_after"] - s["accuracy_before"]
    rows = [
        (f"held-out accuracy ({s['n_eval_problems']} problems)",
         f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} ({gain:+.3f})"),
        ("steps / eta / objective", f"{s['steps']} / {s['eta']} / {s['objective']}"),
        ("max staleness seen", str(s["max_staleness_observed"])),
        ("effective training throughput", f"{s['effective_train_tokens_per_s']:.0f} tokens/s"),
        ("RL time / wall time", f"{s['rl_time_s']:.0f} s / {s['wall_time_s']:.0f} s"),
        ("ledger", "every trajectory trained exactly once" if s["ledger_check"]["ok"] else str(s["ledger_check"])),
        ("run folder", f"`{run_dir}`"),
    ]
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from step", str(s["resumed_from_step"])))
    out = [f"### {s['name']}: held-out accuracy {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}", "",
           "| | |", "|:---|:---|", *(f"| {k} | {v} |" for k, v in rows), "", "### Checkpoint evaluations", ""]
    store = CheckpointStore(s["checkpoints"])
    marked = [v for v in range(s["final_version"] + 1) if should_evaluate(v, s["final_version"], evaluate_every)]
    for v in marked:
        url = store.version_url(v)
        out.append(f"- [{evaluation_name(url, run_dir)}]({ui_url}/artifacts/key/{evaluation_key(url, run_dir)}): "
                   f"`{url}`")
    if not marked:
        out.append(f"none: evaluate_every = {evaluate_every} marks no checkpoint for the evaluate deployment")
    else:
        out += ["", "Each link opens once the evaluate deployment (`areal-flow stack up`) has scored that checkpoint."]
    return "\n".join(out)


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
    from areal_core.prompt_sampling import describe_mix
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
            mix = {k[len("mix_"):]: v for k, v in row.items() if k.startswith("mix_")}
            acc = (f"accuracy {row['accuracy']:.3f}" if not mix else  # the curriculum draws harder prompts
                   f"accuracy on the curriculum's prompts {row['accuracy']:.3f} "
                   f"(next draws: {describe_mix(mix, cfg.data.curriculum.by)})")
            logger.info("step %d/%d reward %.3f %s staleness<=%d answer len %.1f tokens/s %.0f",
                        step, row["total_steps"], row["reward"], acc, row["staleness_max"],
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
    from prefect.settings import PREFECT_UI_URL

    create_markdown_artifact(result_markdown(summary, str(run_dir), evaluate_every, (PREFECT_UI_URL.value() or "").rstrip("/")),
                             key=_artifact_key(cfg.name, run_dir, "result"),
                             description=f"result of training {cfg.name} -> {run_dir}")
    return summary
