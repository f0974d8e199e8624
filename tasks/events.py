"""The checkpoint-published event: one place for its name, resource and payload.

Resource: ``areal.run.<absolute run folder>``, with the labels ``areal.run_dir`` and
``areal.evaluate`` ("true" for the checkpoints the evaluate deployment should pick up).
Payload: ``url`` (the checkpoint), ``version``, ``run_dir``, ``eval_dir`` (where an
evaluation of it belongs) and ``final``. prefect.yaml's evaluate trigger reads these.
"""

from __future__ import annotations

import os

from prefect.events import emit_event

from areal_core.report.compare import eval_dir_for_run

CHECKPOINT_EVENT = "areal.checkpoint.published"


def should_evaluate(version: int, total_steps: int, evaluate_every: int | None) -> bool:
    """None: every checkpoint (v0 included); 0: none; k: every k-th version after v0, and the final one."""
    if evaluate_every is None:
        return True
    if evaluate_every <= 0:
        return False
    return version > 0 and (version % evaluate_every == 0 or version == total_steps)


def emit_checkpoint_published(
    run_dir: str, name: str, version: int, url: str, total_steps: int, evaluate_every: int | None
):
    run_dir = os.path.abspath(run_dir)
    return emit_event(
        event=CHECKPOINT_EVENT,
        resource={
            "prefect.resource.id": f"areal.run.{run_dir}",
            "prefect.resource.name": name,
            "areal.run_dir": run_dir,
            "areal.evaluate": str(should_evaluate(version, total_steps, evaluate_every)).lower(),
        },
        payload={
            "url": url,
            "version": version,
            "run_dir": run_dir,
            "eval_dir": eval_dir_for_run(run_dir, version),
            "final": version == total_steps,
        },
    )
