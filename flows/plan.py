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

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WeightUpdateMode
from areal_core.sim.planner import DEFAULT_ETAS
from areal_core.sim.request import PlanOutcome, build_request, run_plan
from tasks.flow_runs import plan_run_name


@task(name="simulate-plan")
def simulate_plan_task(request: dict, out_dir: str) -> PlanOutcome:
    return run_plan(build_request(**request), out_dir)


def _plot_markdown(png: str) -> str:
    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f"![predicted throughput against the rollout:trainer split](data:image/png;base64,{data})\n\nPlot: `{png}`"


@flow(name="plan", log_prints=True, flow_run_name=plan_run_name)
def plan(
    model: str = "7B",
    gpu: str = "H800",
    n_gpus: int = 64,
    context: int = 16384,
    prompt_tokens: int = 1024,
    answer_median: float = 4000.0,
    answer_sigma: float = 0.9,
    from_run: str | None = None,
    etas: tuple[int, ...] = DEFAULT_ETAS,
    ratios: list[str] | None = None,
    prompts_per_step: int = 128,
    answers_per_prompt: int = 16,
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
    n_steps: int = 30,
    out_dir: str = "runs/plan",
) -> dict:
    """Recommend a cluster run's rollout:trainer split and eta by simulation (docs/PLANNING.md).

    Args:
        model: Model size: 1.5B, 7B or 32B, or a name that carries one (DeepSeek-R1-Distill-Qwen-7B).
        gpu: H800, H100, A100 or H200.
        n_gpus: GPUs in all.
        context: Context length: prompt + answer tokens.
        prompt_tokens: Prompt length in tokens.
        answer_median: Median answer length of the lognormal answer-length distribution.
        answer_sigma: Log-space standard deviation of that lognormal (0: every answer the median).
        from_run: Draw answer lengths from a past run folder instead (its ledger.parquet).
        etas: Staleness bounds to try, e.g. [1, 2, 4, 8].
        ratios: Rollout:trainer splits to try, e.g. ["1:1", "3:1", "7:1"]. None: 3/8 to 7/8 of the GPUs.
        prompts_per_step: Prompts per training batch.
        answers_per_prompt: Answers per prompt.
        weight_update: What a weight update does to answers in flight: reprefill, keep_kv or drain.
        n_steps: Training steps to simulate per alternative.
        out_dir: Where plan.json and plan_ratio.png go.
    """
    request = dict(
        model=model,
        gpu=gpu,
        n_gpus=n_gpus,
        context=context,
        prompt_tokens=prompt_tokens,
        answer_median=answer_median,
        answer_sigma=answer_sigma,
        from_run=from_run,
        etas=etas,
        ratios=ratios,
        prompts_per_step=prompts_per_step,
        answers_per_prompt=answers_per_prompt,
        weight_update=weight_update,
        n_steps=n_steps,
    )
    build_request(**request)  # bad input fails the flow run before any simulation
    outcome = simulate_plan_task(request, out_dir)
    rows = [
        {
            "alternative": a.label,
            "tokens_per_s": round(a.throughput),
            "vs_sync": round(a.speedup, 2),
            "staleness_mean": round(a.staleness_mean, 2),
            "staleness_max": a.staleness_max,
            "rollout_busy": round(a.rollout_util, 2),
            "trainer_busy": round(a.trainer_util, 2),
        }
        for a in outcome.alternatives
    ]
    create_table_artifact(rows, key="plan-alternatives", description=outcome.request.describe())
    create_markdown_artifact(
        outcome.markdown + "\n\n" + _plot_markdown(outcome.files["png"]),
        key="plan",
        description=f"recommended: {outcome.recommended.label}",
    )
    print(outcome.markdown)
    return {**outcome.to_json(), "files": outcome.files}
