"""Prefect task: evaluate one checkpoint on benchmarks (generation + Dask grading); the names an
evaluation goes by in the UI (its flow run and its artifact), and the lines of a training run's
result that link its evaluations."""

from __future__ import annotations

import json
import re

from prefect import task

from tasks.flow_runs import artifact_key, latest_artifacts, ui_link, update_markdown


def evaluation_name(checkpoint_url: str, run_dir: str | None = None) -> str:
    """``evaluate-<run>-v<N>``: the run (``run_dir``'s name, else the folder above ``checkpoints``)
    and the version of the checkpoint."""
    parts = checkpoint_url.rstrip("/").split("/")
    version = parts[-1]
    run = (run_dir or "").rstrip("/").rsplit("/", 1)[-1] or (
        parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-2] if len(parts) >= 2 else "model"
    )
    return f"evaluate-{run}-{version}"


def evaluation_key(checkpoint_url: str, run_dir: str | None = None) -> str:
    """The evaluation's artifact key, one per run and version (keys: lowercase, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", evaluation_name(checkpoint_url, run_dir).lower()).strip("-")
    return slug.replace("evaluate-", "evaluation-", 1)[:100]


def _pass_at_1(run_dir: str, version: int) -> str:
    """The evaluation's pass@1 per bench, from ``<run>/evals/v<N>/summary.json`` ('' if not there)."""
    from areal_core.report.compare import eval_dir_for_run
    from areal_core.report.ui import for_people
    from areal_core.storage.fsutil import filesystem, join

    fs, path = filesystem(join(eval_dir_for_run(run_dir, version), "summary.json"))
    if not fs.exists(path):
        return ""
    benches = json.loads(fs.cat_file(path))["benchmarks"]
    return ", ".join(f"{name} pass@1 {for_people(float(b['pass@1']))}" for name, b in benches.items())


def linked_line(version: int, name: str, artifact_id, run_dir: str) -> str:
    """A result line linking checkpoint ``version``'s evaluation artifact, with its pass@1."""
    return f"- v{version}: [{name}]({ui_link(f'artifacts/artifact/{artifact_id}')}): {_pass_at_1(run_dir, version) or 'scored'}"


def evaluation_lines(run_dir: str, checkpoints: str, final_version: int, evaluate_every: int | None) -> list[str]:
    """One line per checkpoint the run marked for the evaluate deployment: a link to its evaluation's
    artifact and its pass@1 once it is scored, else what will score it."""
    from areal_core.storage import CheckpointStore
    from tasks.events import should_evaluate

    store = CheckpointStore(checkpoints)
    marked = [v for v in range(final_version + 1) if should_evaluate(v, final_version, evaluate_every)]
    if not marked:
        return [f"none: evaluate_every = {evaluate_every} marks no checkpoint for the evaluate deployment"]
    keys = {v: evaluation_key(store.version_url(v), run_dir) for v in marked}
    found = latest_artifacts(list(keys.values()))
    lines = []
    for v in marked:
        name, art = evaluation_name(store.version_url(v), run_dir), found.get(keys[v])
        if art is not None:
            lines.append(linked_line(v, name, art.latest_id, run_dir))
        else:
            lines.append(
                f"- v{v}: {name}: not scored yet (the evaluate deployment scores it while `areal-flow stack up` runs)"
            )
    return lines


def link_in_training_result(run_dir: str, version: int, line: str) -> bool:
    """Put ``line`` in place of checkpoint ``version``'s line in the training run's result artifact
    (if that run has one yet: an evaluation can finish before its run). True if it was updated."""
    key = artifact_key("train-result", run_dir)
    art = latest_artifacts([key]).get(key)
    if art is None or not isinstance(art.data, str):
        return False
    new = re.sub(rf"^- v{version}: .*$", line.replace("\\", "\\\\"), art.data, count=1, flags=re.M)
    if new == art.data:
        return False
    update_markdown(art.latest_id, new)
    return True


@task(name="evaluate-checkpoint")
def evaluate_checkpoint_task(checkpoint_url: str, benches: list[str], **options) -> dict:
    """``areal_core.eval.harness.evaluate_checkpoint`` as a task (its keyword options, no progress bars)."""
    from areal_core.eval.harness import evaluate_checkpoint  # heavy imports: only when the task runs

    return evaluate_checkpoint(checkpoint_url, benches, progress=False, **options)
