"""Prefect flow: replay a run's recorded training steps (``areal-flow replay``), with no rollout server.
Its artifacts: the checkpoint-by-checkpoint comparison, linked to the original run's own artifacts."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from tasks.flow_runs import artifact_key, replay_run_name, ui_link


@flow(name="replay", log_prints=True, flow_run_name=replay_run_name)
def replay_run(
    run_dir: str,
    out_dir: str,
    from_step: int = 0,
    to_step: int | None = None,
    overrides: dict | None = None,
    threads: int | None = None,
    tolerant: bool = False,
) -> dict:
    """Train a run's recorded steps again from one of its checkpoints and compare the weights.

    Args:
        run_dir: The original run's folder (it holds schedule/ and checkpoints/).
        out_dir: The replay's run folder (new).
        from_step: Start from the original's checkpoint v<from_step> (0: the start).
        to_step: Stop after this step (None: the original's last).
        overrides: Trainer settings to change, e.g. {"trainer.objective": "naive"}: a counterfactual
            replay of the same data (None: an exact replay, checked bit for bit).
        threads: The trainer's torch threads (None: the machine's cores; the torch trainer's
            results do not depend on the count, and every checkpoint's hash says so).
        tolerant: Where the weights differ from the original's (another CPU kind), train on to the
            last step and measure the drift instead of stopping at the first difference.
    """
    from areal_core.run.replay import replay

    summary = replay(
        run_dir, out_dir, from_step=from_step, to_step=to_step, overrides=overrides, threads=threads, tolerant=tolerant
    )
    create_markdown_artifact(
        replay_markdown(summary, out_dir), key=artifact_key("replay", out_dir), description=f"replay of {run_dir}"
    )
    return summary


def replay_markdown(summary: dict, out_dir: str) -> str:
    r = summary["replay"]
    keys = [artifact_key(k, r["of"]) for k in ("train-result", "train-curves")]
    original = [f"[{key}]({ui_link('artifacts/key/' + key)})" for key in keys]
    lines = [
        f"# Replay of `{r['of']}`",
        "",
        f"**{r['note']}**",
        "",
        f"Steps {r['from_step'] + 1}..{r['to_step']} from checkpoint v{r['from_step']}"
        + (f", with {r['overrides']}" if r["overrides"] else "")
        + f"; output in `{out_dir}`.",
        f"The original run's artifacts: {', '.join(original)}.",
        "",
        "| version | replay sha256 | original sha256 | same |",
        "|---|---|---|---|",
    ]
    for c in summary["checkpoints"]:
        orig = c["original_sha256"] or "(none recorded)"
        lines.append(f"| v{c['version']} | `{c['sha256'][:16]}` | `{orig[:16]}` | {'yes' if c['match'] else 'no'} |")
    d = summary.get("first_difference")
    if d:
        lines += ["", f"First difference: step {d['step']}, {d['figure']} {d['original']!r} -> {d['replay']!r}."]
    w = summary.get("final_distance")
    if w:
        lines.append(
            f"Final weights against the original's: {w['tensors_differing']} of {w['tensors']} tensors differ, "
            f"max abs {w['max_abs']:.3g}, relative L2 distance {w['relative_l2']:.3g}."
        )
    return "\n".join(lines)
