"""Prefect task: evaluate one checkpoint on benchmarks (generation + Dask grading), and the names
an evaluation goes by in the UI (its flow run and its artifact)."""

from __future__ import annotations

import re

from prefect import task


def evaluation_name(checkpoint_url: str, run_dir: str | None = None) -> str:
    """``evaluate-<run>-v<N>``: the run (``run_dir``'s name, else the folder above ``checkpoints``)
    and the version of the checkpoint."""
    parts = checkpoint_url.rstrip("/").split("/")
    version = parts[-1]
    run = (run_dir or "").rstrip("/").rsplit("/", 1)[-1] or \
        (parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-2] if len(parts) >= 2 else "model")
    return f"evaluate-{run}-{version}"


def evaluation_key(checkpoint_url: str, run_dir: str | None = None) -> str:
    """The evaluation's artifact key, one per run and version (keys: lowercase, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", evaluation_name(checkpoint_url, run_dir).lower()).strip("-")
    return slug.replace("evaluate-", "evaluation-", 1)[:100]


@task(name="evaluate-checkpoint")
def evaluate_checkpoint_task(checkpoint_url: str, benches: list[str], out_dir: str, samples: int = 1,
                             limit: int | None = None, temperature: float | None = None, top_p: float | None = None,
                             max_new_tokens: int | None = None, scheduler_address: str | None = None,
                             run_dir: str | None = None) -> dict:
    from areal_core.eval.harness import evaluate_checkpoint  # heavy imports: only when the task runs

    return evaluate_checkpoint(checkpoint_url, benches, out_dir=out_dir, samples=samples, limit=limit,
                               temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               scheduler_address=scheduler_address, progress=False, run_dir=run_dir)
