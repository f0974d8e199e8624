"""Prefect task: evaluate one checkpoint on benchmarks (generation + Dask grading)."""

from __future__ import annotations

from prefect import task


@task(name="evaluate-checkpoint")
def evaluate_checkpoint_task(checkpoint_url: str, benches: list[str], out_dir: str, samples: int = 1,
                             limit: int | None = None, temperature: float = 0.6, top_p: float = 0.95,
                             max_new_tokens: int | None = None, scheduler_address: str | None = None) -> dict:
    from areal_core.eval.harness import evaluate_checkpoint  # heavy imports: only when the task runs

    return evaluate_checkpoint(checkpoint_url, benches, out_dir=out_dir, samples=samples, limit=limit,
                               temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               scheduler_address=scheduler_address, progress=False)
