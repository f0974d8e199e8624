"""Prefect flow: evaluate one checkpoint on benchmarks; per-problem parquet, a summary, and an artifact
with the rounded scores and a pass@k plot.

The evaluate deployment runs this on every ``areal.checkpoint.published`` event marked
``areal.evaluate: "true"`` (see prefect.yaml), with the event's checkpoint URL, run folder and
eval folder: a run's checkpoint is scored on that run's own held-out split and settings
(bench ``heldout``) unless other benches are given. Once scored, the training run's result
artifact links this evaluation directly.
"""

from __future__ import annotations

import re

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from areal_core.report.compare import eval_dir_for_checkpoint
from tasks.evaluation import (
    evaluate_checkpoint_task,
    evaluation_key,
    evaluation_name,
    link_in_training_result,
    linked_line,
)
from tasks.provision import apply_s3_credentials_block


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return evaluation_name(p["checkpoint_url"], p.get("run_dir"))


@flow(name="evaluate", log_prints=True, flow_run_name=_flow_run_name)
def evaluate(
    checkpoint_url: str,
    benches: list[str] | None = None,
    out_dir: str | None = None,
    version: int | None = None,
    samples: int = 1,
    limit: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    reward: dict | None = None,
    s3_credentials_block: str | None = None,
    run_dir: str | None = None,
) -> dict:
    """Score one checkpoint: answers generated on a rollout server, graded as Dask tasks.

    Args:
        checkpoint_url: The checkpoint version to score: RUN/checkpoints/vN, an s3:// version URL,
            or a Hugging Face model folder. Triggered runs get it from the checkpoint event.
        benches: Benchmarks, e.g. ["heldout"] (the training run's own held-out split, sampled as the
            run did), ["synthetic"], ["gsm8k", "math500"]. None: heldout for a run's
            checkpoint, else synthetic.
        out_dir: Where results go (<bench>/results.parquet, summary.json). None:
            RUN/evals/vN.
        version: The checkpoint's version, for the run's report (triggered runs: from the event).
        samples: Answers per problem (k of pass@k).
        limit: Score only the first N problems of each benchmark. None: all.
        temperature: Sampling temperature. None: each benchmark's own (heldout: the run's).
        top_p: Nucleus sampling mass. None: each benchmark's own.
        max_new_tokens: Longest answer. None: each benchmark's own.
        reward: Where the answers are graded, as a run's reward section: e.g.
            {"scheduler_address": "tls://dask-host:8786", "tls_ca_file": "/etc/areal/ca.pem",
            "tls_client_cert": "/etc/areal/client.pem", "tls_client_key": "/etc/areal/client.key"}.
            None: a local Dask cluster.
        s3_credentials_block: A Prefect Secret block holding AWS_* variables for s3:// checkpoints.
            None: the worker's environment.
        run_dir: The training run the checkpoint belongs to (found by itself for RUN/checkpoints/vN).
    """
    from areal_core.eval.harness import HELDOUT, grading_config, run_folder_of
    from areal_core.report.ui import evaluation_markdown, run_evaluations

    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    run_dir = run_dir or run_folder_of(checkpoint_url)
    benches = benches or [HELDOUT if run_dir else "synthetic"]
    out_dir = out_dir or eval_dir_for_checkpoint(checkpoint_url)
    summary = evaluate_checkpoint_task(
        checkpoint_url,
        benches,
        out_dir=out_dir,
        samples=samples,
        limit=limit,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        grading=grading_config(reward),
        run_dir=run_dir,
    )
    name = evaluation_name(checkpoint_url, run_dir)
    artifact_id = create_markdown_artifact(
        evaluation_markdown(name, summary, out_dir, run_evaluations(run_dir) if run_dir else None),
        key=evaluation_key(checkpoint_url, run_dir),
        description=f"{name}: {checkpoint_url}",
    )
    m = re.search(r"/v(\d+)$", checkpoint_url.rstrip("/"))
    version = version if version is not None else int(m.group(1)) if m else None
    if run_dir and version is not None:  # the training run's result links this evaluation
        link_in_training_result(run_dir, version, linked_line(version, name, artifact_id, run_dir))
    for b, s in summary["benchmarks"].items():
        print(f"{b}: pass@1 {s['pass@1']:.3f} on {s['n_problems']} problems")
    print(f"results: {out_dir}")
    return summary
