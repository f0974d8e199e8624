"""Prefect flow: evaluate one checkpoint on benchmarks; per-problem parquet, a summary, a table artifact.

The evaluate deployment runs this on every ``areal.checkpoint.published`` event marked
``areal.evaluate: "true"`` (see prefect.yaml), with the event's checkpoint URL and eval folder.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from areal_core.report import eval_dir_for_checkpoint
from tasks.evaluation import evaluate_checkpoint_task
from tasks.provision import apply_s3_credentials_block


@flow(name="evaluate", log_prints=True)
def evaluate(checkpoint_url: str, benches: list[str] | None = None, out_dir: str | None = None,
             version: int | None = None, samples: int = 1, limit: int | None = None,
             temperature: float = 0.6, top_p: float = 0.95, max_new_tokens: int | None = None,
             scheduler_address: str | None = None, s3_credentials_block: str | None = None) -> dict:
    """``scheduler_address``: grade on an existing Dask cluster (default: a local cluster);
    ``s3_credentials_block``: a Prefect Secret block with AWS_* variables for s3:// checkpoints."""
    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    benches = benches or ["synthetic"]
    out_dir = out_dir or eval_dir_for_checkpoint(checkpoint_url)
    summary = evaluate_checkpoint_task(checkpoint_url, benches, out_dir, samples, limit, temperature, top_p,
                                       max_new_tokens, scheduler_address)
    rows = [{"bench": b, **{k: v for k, v in s.items() if isinstance(v, (int, float, str, bool))}}
            for b, s in summary["benchmarks"].items()]
    create_table_artifact(rows, key="evaluation", description=f"{checkpoint_url} (version {version})")
    for r in rows:
        print(f"{r['bench']}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "bench"))
    print(f"results: {out_dir}")
    return summary


if __name__ == "__main__":
    evaluate("runs/quickstart/checkpoints/v150")
