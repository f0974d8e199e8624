"""One planning request as `areal-flow plan` and the `plan` flow take it, and what it gives.

    req = build_request(model="7B", gpu="H800", n_gpus=64, context=16384)
    outcome = run_plan(req, out_dir="runs/plan")   # plan.json and plan_ratio.png there

Every bad input is a ValueError whose message starts with the argument it is about
(the CLI prints it as one `error:` line).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WeightUpdateMode, weight_update_mode
from areal_core.sim.cost import Efficiency, smallest_rollout_tp
from areal_core.sim.hardware import GPUS, MODELS, GPUSpec, ModelSpec
from areal_core.sim.lengths import LengthDist
from areal_core.sim.planner import DEFAULT_ETAS, Alternative, format_plan, plan, recommend

P90_Z = 1.2815515655446004  # the standard normal's 90th percentile


def model_preset(name: str) -> ModelSpec:
    """A preset by its size ("7B", "7b") or a model name that carries it
    ("DeepSeek-R1-Distill-Qwen-7B", "Qwen2.5-32B-Instruct")."""
    by_size = {k.lower(): v for k, v in MODELS.items()}
    key = name.strip().lower()
    if key not in by_size:
        sizes = re.findall(r"(?<![\d.])(\d+(?:\.\d+)?b)(?![a-z0-9])", key)
        key = next((s for s in sizes if s in by_size), key)
    if key not in by_size:
        raise ValueError(
            f"model: unknown model {name!r}; known sizes: {', '.join(MODELS)} "
            f"(Qwen2.5 / R1-Distill-Qwen shapes), or a name that contains one"
        )
    return by_size[key]


def gpu_preset(name: str) -> GPUSpec:
    by_name = {k.lower(): v for k, v in GPUS.items()}
    if name.strip().lower() not in by_name:
        raise ValueError(f"gpu: unknown GPU type {name!r}; known: {', '.join(GPUS)}")
    return by_name[name.strip().lower()]


def parse_ratio(text: str) -> tuple[int, int]:
    """'3:1' -> (3, 1): rollout devices to trainer devices."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"ratio: expected ROLLOUT:TRAINER such as 3:1, got {text!r}")
    r, t = int(m.group(1)), int(m.group(2))
    if r + t == 0:
        raise ValueError(f"ratio: {text!r} gives no device to either side")
    return r, t


def rollout_counts(n_gpus: int, tp: int, ratios) -> list[int]:
    """Rollout devices for each ratio, rounded to whole servers of `tp` devices."""
    counts = []
    for r, t in ratios:
        n = round(n_gpus * r / (r + t) / tp) * tp
        if n >= n_gpus:
            raise ValueError(
                f"ratio: {r}:{t} leaves no trainer device of {n_gpus} GPUs ({n_gpus} would serve, in servers of {tp})"
            )
        if n < tp:
            raise ValueError(f"ratio: {r}:{t} leaves no rollout server of {n_gpus} GPUs (a server takes {tp})")
        counts.append(n)
    return sorted(set(counts))


def lengths_from_run(run_dir: str, max_new_tokens: int) -> tuple[LengthDist, str]:
    """A past run's answer lengths: every trained answer from its ledger.parquet, else a
    lognormal through the per-step median and 90th percentile of its metrics.parquet."""
    import pandas as pd

    run = Path(run_dir)
    if (run / "ledger.parquet").is_file():
        n = pd.read_parquet(run / "ledger.parquet", columns=["n_tokens"])["n_tokens"].to_numpy()
        if n.size == 0:
            raise ValueError(f"from_run: {run}/ledger.parquet holds no trained answer")
        dist = LengthDist.empirical(n, max_new_tokens)
        return dist, f"{n.size} trained answers of {run} (mean {n.mean():.0f} tokens)"
    if (run / "metrics.parquet").is_file():
        m = pd.read_parquet(run / "metrics.parquet")
        if not {"answer_len_p50", "answer_len_p90"} <= set(m.columns) or m.empty:
            raise ValueError(f"from_run: {run}/metrics.parquet has no answer_len_p50 / answer_len_p90")
        p50, p90 = float(m["answer_len_p50"].median()), float(m["answer_len_p90"].median())
        sigma = max(np.log(max(p90, p50) / p50), 0.0) / P90_Z
        dist = LengthDist(max_new_tokens=max_new_tokens, median=p50, sigma=sigma)
        return dist, f"lognormal through {run}'s answer lengths (median {p50:.0f}, p90 {p90:.0f})"
    raise ValueError(f"from_run: {run} holds neither ledger.parquet nor metrics.parquet (not a run folder)")


@dataclass(frozen=True)
class PlanRequest:
    """A validated planning request (see `build_request`)."""

    model: ModelSpec
    gpu: GPUSpec
    n_gpus: int
    context: int
    prompt_tokens: int
    lengths: LengthDist
    lengths_source: str
    etas: tuple[int, ...] = DEFAULT_ETAS
    ratios: tuple[tuple[int, int], ...] | None = None
    prompts_per_step: int = 128
    answers_per_prompt: int = 16
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE
    n_steps: int = 30
    warmup_steps: int = 10
    seed: int = 0
    efficiency: Efficiency = field(default_factory=Efficiency)
    from_run: str | None = None  # the run the lengths came from: its cost ledger is shown beside the plan

    def describe(self) -> str:
        return (
            f"{self.model.name} on {self.n_gpus} x {self.gpu.name}, context {self.context:,} "
            f"({self.prompt_tokens:,}-token prompts), {self.prompts_per_step} prompts x "
            f"{self.answers_per_prompt} answers per step, {self.weight_update} updates; answers: {self.lengths_source}"
        )


def build_request(
    *,
    model: str = "7B",
    gpu: str = "H800",
    n_gpus: int = 64,
    context: int = 16384,
    prompt_tokens: int = 1024,
    answer_median: float = 4000.0,
    answer_sigma: float = 0.9,
    answer_lengths: list[int] | None = None,
    from_run: str | None = None,
    etas=DEFAULT_ETAS,
    ratios: list[str] | None = None,
    prompts_per_step: int = 128,
    answers_per_prompt: int = 16,
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
    n_steps: int = 30,
    warmup_steps: int | None = None,
    seed: int = 0,
) -> PlanRequest:
    """Check every input and build the request; the answer lengths come from `from_run`, else
    `answer_lengths` (an empirical distribution), else a lognormal (`answer_median`,
    `answer_sigma`), all clipped at `context - prompt_tokens`. Warm-up: the first third of
    the steps unless given (the asynchronous pipeline fills in its first eta steps)."""
    if warmup_steps is None:
        warmup_steps = n_steps // 3
    for name, value in (
        ("n_gpus", n_gpus),
        ("context", context),
        ("prompts_per_step", prompts_per_step),
        ("answers_per_prompt", answers_per_prompt),
        ("n_steps", n_steps),
    ):
        if value < 1:
            raise ValueError(f"{name}: must be at least 1, got {value}")
    for name, value in (("prompt_tokens", prompt_tokens), ("seed", seed), ("warmup_steps", warmup_steps)):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
    if warmup_steps >= n_steps:
        raise ValueError(f"warmup_steps: must be below n_steps ({n_steps}), got {warmup_steps}")
    if prompt_tokens >= context:
        raise ValueError(f"context: {context} leaves no room to answer after {prompt_tokens}-token prompts")
    weight_update_mode(weight_update)
    etas = tuple(sorted({int(e) for e in etas}))
    if not etas or etas[0] < 0:
        raise ValueError(f"eta: candidates must be whole numbers >= 0, got {list(etas)}")
    max_new = context - prompt_tokens
    if from_run:
        lengths, source = lengths_from_run(from_run, max_new)
    elif answer_lengths:
        lengths = LengthDist.empirical(answer_lengths, max_new)
        source = f"{len(answer_lengths)} given lengths (mean {np.mean(answer_lengths):.0f})"
    else:
        lengths = LengthDist(max_new_tokens=max_new, median=answer_median, sigma=answer_sigma)
        source = f"lognormal, median {answer_median:g}, sigma {answer_sigma:g}, clipped at {max_new:,}"
    req = PlanRequest(
        model=model_preset(model),
        gpu=gpu_preset(gpu),
        n_gpus=n_gpus,
        context=context,
        prompt_tokens=prompt_tokens,
        lengths=lengths,
        lengths_source=source,
        etas=etas,
        ratios=tuple(parse_ratio(r) for r in ratios) if ratios else None,
        prompts_per_step=prompts_per_step,
        answers_per_prompt=answers_per_prompt,
        weight_update=weight_update,
        n_steps=n_steps,
        warmup_steps=warmup_steps,
        seed=seed,
        from_run=from_run,
    )
    if req.ratios:  # a bad split fails here, before any simulation
        rollout_counts(n_gpus, _server_devices(req), req.ratios)
    return req


def _server_devices(req: PlanRequest) -> int:
    return smallest_rollout_tp(req.model, req.gpu, req.context, req.efficiency)


@dataclass
class PlanOutcome:
    request: PlanRequest
    alternatives: list[Alternative]
    recommended: Alternative
    markdown: str
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        r = self.request
        return {
            "request": {
                "model": r.model.name,
                "gpu": r.gpu.name,
                "n_gpus": r.n_gpus,
                "context": r.context,
                "prompt_tokens": r.prompt_tokens,
                "answers": r.lengths_source,
                "etas": list(r.etas),
                "ratios": [f"{a}:{b}" for a, b in r.ratios] if r.ratios else None,
                "prompts_per_step": r.prompts_per_step,
                "answers_per_prompt": r.answers_per_prompt,
                "weight_update": r.weight_update,
                "n_steps": r.n_steps,
                "warmup_steps": r.warmup_steps,
                "seed": r.seed,
            },
            "recommended": {"label": self.recommended.label, **asdict(self.recommended)},
            "alternatives": [{"label": a.label, **asdict(a)} for a in self.alternatives],
        }


def _ledger_lines(run_dir: str) -> str:
    """The cost ledger of the run the lengths came from, in the stages the plan's columns name."""
    from areal_core.run.costs import describe_shares, shares

    path = Path(run_dir, "summary.json")
    totals = json.loads(path.read_text()).get("cost") if path.is_file() else None
    if not totals:
        return f"{run_dir} has no cost ledger (summary.json's cost): only its answer lengths were used."
    return (
        f"**{run_dir}, measured** (its cost ledger, summary.json; each pool's time by stage, the stages the "
        f"columns above simulate as `generating` and `training`): {describe_shares(shares(totals))}. The plan "
        f"simulates the cluster asked for, not that run's machine."
    )


def run_plan(req: PlanRequest, out_dir: str | Path | None = None) -> PlanOutcome:
    """Simulate every alternative; with `out_dir`, write plan.json and plan_ratio.png there."""
    tp = _server_devices(req)
    counts = rollout_counts(req.n_gpus, tp, req.ratios) if req.ratios else None
    alternatives = plan(
        req.model,
        req.gpu,
        req.n_gpus,
        req.lengths,
        prompt_tokens=req.prompt_tokens,
        prompts_per_step=req.prompts_per_step,
        answers_per_prompt=req.answers_per_prompt,
        etas=req.etas,
        rollout_counts=counts,
        weight_update=req.weight_update,
        n_steps=req.n_steps,
        warmup_steps=req.warmup_steps,
        seed=req.seed,
        efficiency=req.efficiency,
    )
    best = recommend(alternatives)
    lines = [
        f"Plan for {req.describe()}.",
        "",
        format_plan(alternatives),
        "",
        (
            f"**Recommended: {best.label}**: {best.throughput:,.0f} trained tokens/s, {best.speedup:.2f}x "
            f"synchronous, staleness mean {best.staleness_mean:.2f} (max {best.staleness_max})."
        ),
    ]
    if not any(a.mode == "async" for a in alternatives):
        lines.append(
            "No asynchronous split leaves its trainer enough memory for the training state: "
            "only the synchronous setting fits."
        )
    if req.from_run:
        lines += ["", _ledger_lines(req.from_run)]
    outcome = PlanOutcome(req, alternatives, best, "\n".join(lines))
    if out_dir is not None:
        from areal_core.sim.figures import plot_ratio

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        title = (
            f"{req.model.name} on {req.n_gpus} {req.gpu.name}, context {req.context:,}, "
            f"{req.prompts_per_step} x {req.answers_per_prompt} per step (simulated)"
        )
        png = plot_ratio(alternatives, out / "plan_ratio.png", title)
        outcome.files = {"json": str(out / "plan.json"), "png": str(png)}
        (out / "plan.json").write_text(json.dumps(outcome.to_json(), indent=1) + "\n")
    return outcome
