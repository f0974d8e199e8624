"""Prefect flow: plan a cluster run's rollout:trainer split and eta by simulation.

A thin wrapper of `areal_core.sim` (the simulator runs in one task): the run publishes the
alternatives as a table artifact and the recommendation with the throughput-vs-ratio plot
as a markdown artifact (the plot embedded, and its file named), and writes plan.json and
plan_ratio.png to `out_dir`. `areal-flow plan` is the same without Prefect.
"""

from __future__ import annotations

import base64
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from areal_core.sim.planner import DEFAULT_ETAS
from areal_core.sim.request import PlanOutcome, build_request, run_plan


@task(name="simulate-plan")
def simulate_plan_task(request: dict, out_dir: str) -> PlanOutcome:
    return run_plan(build_request(**request), out_dir)


def _plot_markdown(png: str) -> str:
    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f"![predicted throughput against the rollout:trainer split](data:image/png;base64,{data})\n\nPlot: `{png}`"


@flow(name="plan", log_prints=True)
def plan(model: str = "7B", gpu: str = "H800", n_gpus: int = 64, context: int = 16384, prompt_tokens: int = 1024,
         answer_median: float = 4000.0, answer_sigma: float = 0.9, from_run: str | None = None,
         etas: list[int] = list(DEFAULT_ETAS), ratios: list[str] | None = None, prompts_per_step: int = 128,
         answers_per_prompt: int = 16, weight_update: str = "reprefill", n_steps: int = 30,
         out_dir: str = "runs/plan") -> dict:
    """``model``: 1.5B, 7B, 32B (or a name carrying the size); ``gpu``: H800, H100, A100, H200;
    answer lengths from ``from_run`` (a past run folder) or a lognormal (``answer_median``,
    ``answer_sigma``); ``ratios``: rollout:trainer splits such as "3:1" (default: 3/8 to 7/8 of
    the devices); ``etas``: the staleness bounds to try."""
    request = dict(model=model, gpu=gpu, n_gpus=n_gpus, context=context, prompt_tokens=prompt_tokens,
                   answer_median=answer_median, answer_sigma=answer_sigma, from_run=from_run, etas=etas,
                   ratios=ratios, prompts_per_step=prompts_per_step, answers_per_prompt=answers_per_prompt,
                   weight_update=weight_update, n_steps=n_steps)
    build_request(**request)  # bad input fails the flow run before any simulation
    outcome = simulate_plan_task(request, out_dir)
    rows = [{"alternative": a.label, "tokens_per_s": round(a.throughput), "vs_sync": round(a.speedup, 2),
             "staleness_mean": round(a.staleness_mean, 2), "staleness_max": a.staleness_max,
             "rollout_busy": round(a.rollout_util, 2), "trainer_busy": round(a.trainer_util, 2)}
            for a in outcome.alternatives]
    create_table_artifact(rows, key="plan-alternatives", description=outcome.request.describe())
    create_markdown_artifact(outcome.markdown + "\n\n" + _plot_markdown(outcome.files["png"]), key="plan",
                             description=f"recommended: {outcome.recommended.label}")
    print(outcome.markdown)
    return {**outcome.to_json(), "files": outcome.files}


if __name__ == "__main__":
    plan()
