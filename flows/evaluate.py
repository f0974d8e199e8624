"""Prefect flow: evaluate one checkpoint on benchmarks; per-problem parquet, a summary, a table artifact.

The evaluate deployment runs this on every ``areal.checkpoint.published`` event marked
``areal.evaluate: "true"`` (see prefect.yaml), with the event's checkpoint URL, run folder and
eval folder: a run's checkpoint is scored on that run's own held-out split and settings
(bench ``heldout``) unless other benches are given.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from areal_core.report import eval_dir_for_checkpoint
from tasks.evaluation import evaluate_checkpoint_task, evaluation_key, evaluation_name
from tasks.provision import apply_s3_credentials_block


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return evaluation_name(p["checkpoint_url"], p.get("run_dir"))


@flow(name="evaluate", log_prints=True, flow_run_name=_flow_run_name)
def evaluate(checkpoint_url: str, benches: list[str] | None = None, out_dir: str | None = None,
             version: int | None = None, samples: int = 1, limit: int | None = None,
             temperature: float | None = None, top_p: float | None = None, max_new_tokens: int | None = None,
             scheduler_address: str | None = None, s3_credentials_block: str | None = None,
             run_dir: str | None = None) -> dict:
    """``run_dir``: the training run of the checkpoint; with it (or a local RUN/checkpoints/vN) the
    default bench is ``heldout``, the run's own held-out split sampled as the run did; else
    ``synthetic``. Sampling settings left None take each bench's own.
    ``scheduler_address``: grade on an existing Dask cluster (default: a local cluster);
    ``s3_credentials_block``: a Prefect Secret block with AWS_* variables for s3:// checkpoints."""
    from areal_core.eval.harness import HELDOUT, run_folder_of

    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    run_dir = run_dir or run_folder_of(checkpoint_url)
    benches = benches or [HELDOUT if run_dir else "synthetic"]
    out_dir = out_dir or eval_dir_for_checkpoint(checkpoint_url)
    summary = evaluate_checkpoint_task(checkpoint_url, benches, out_dir, samples, limit, temperature, top_p,
                                       max_new_tokens, scheduler_address, run_dir)
    rows = [{"bench": b, **{k: v for k, v in s.items() if isinstance(v, (int, float, str, bool))}}
            for b, s in summary["benchmarks"].items()]
    create_table_artifact(rows, key=evaluation_key(checkpoint_url, run_dir),
                          description=f"{evaluation_name(checkpoint_url, run_dir)}: {checkpoint_url}")
    for r in rows:
        print(f"{r['bench']}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "bench"))
    print(f"results: {out_dir}")
    return summary


if __name__ == "__main__":
    evaluate("runs/quickstart/checkpoints/v150")
