"""The planner: simulate rollout:trainer splits and eta values, best first.

`plan(...)` runs one asynchronous simulation per (split, eta) and the synchronous
baseline, all on the same answer lengths (same seed), and returns every feasible
alternative sorted by effective training throughput. `recommend` picks the best, or
among those within `tolerance` (5%) of it the one with the smallest eta (fresher data).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WeightUpdateMode
from areal_core.sim.cost import Efficiency, smallest_rollout_tp
from areal_core.sim.engine import SimConfig, SimResult, simulate
from areal_core.sim.hardware import GPUSpec, ModelSpec, gpu_spec, model_spec
from areal_core.sim.lengths import LengthDist

DEFAULT_ROLLOUT_SHARES = (0.375, 0.5, 0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875)
DEFAULT_ETAS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Alternative:
    """One simulated setting and what it gives.

    Attributes:
        mode: "async" or "sync".
        n_rollout_gpus, n_trainer_gpus, rollout_tp, eta: the setting (sync: all devices do both).
        throughput: effective training throughput, trained tokens/s.
        speedup: throughput over the synchronous baseline's.
        staleness_mean, staleness_max: versions between an answer's oldest token and the
            weights it is trained against.
        rollout_util, trainer_util: mean busy shares of the two device pools.
        wall_time_s: time for the simulated steps.
    """

    mode: str
    n_rollout_gpus: int
    n_trainer_gpus: int
    rollout_tp: int
    eta: int
    throughput: float
    speedup: float
    staleness_mean: float
    staleness_max: int
    rollout_util: float
    trainer_util: float
    wall_time_s: float

    @property
    def label(self) -> str:
        if self.mode == "sync":
            return f"sync (all {self.n_rollout_gpus} devices generate, then train)"
        return f"async {self.n_rollout_gpus}:{self.n_trainer_gpus}, eta {self.eta}"


def _alternative(result: SimResult, sync_throughput: float) -> Alternative:
    return Alternative(
        mode=result.mode,
        n_rollout_gpus=result.n_rollout_gpus,
        n_trainer_gpus=result.n_trainer_gpus,
        rollout_tp=result.rollout_tp,
        eta=result.eta,
        throughput=result.effective_throughput,
        speedup=result.effective_throughput / sync_throughput,
        staleness_mean=result.staleness_mean,
        staleness_max=result.staleness_max,
        rollout_util=result.rollout_util,
        trainer_util=result.trainer_util,
        wall_time_s=float(result.wall_time_s),
    )


def candidate_splits(n_gpus: int, tp: int, shares=DEFAULT_ROLLOUT_SHARES) -> list[int]:
    """Rollout device counts for the given shares, rounded to whole servers, leaving at
    least one trainer device."""
    counts = set()
    for share in shares:
        n = round(n_gpus * share / tp) * tp
        if tp <= n < n_gpus:
            counts.add(n)
    return sorted(counts)


def plan(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    n_gpus: int,
    lengths: LengthDist,
    *,
    prompt_tokens: int = 1024,
    prompts_per_step: int = 128,
    answers_per_prompt: int = 16,
    etas=DEFAULT_ETAS,
    rollout_shares=DEFAULT_ROLLOUT_SHARES,
    rollout_counts: list[int] | None = None,
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
    n_steps: int = 30,
    warmup_steps: int = 10,
    seed: int = 0,
    efficiency: Efficiency = Efficiency(),
) -> list[Alternative]:
    """Every feasible alternative (the synchronous baseline included), best first.

    The splits: `rollout_counts` (rollout devices, each a whole number of servers) when
    given, else `rollout_shares` of `n_gpus` rounded to whole servers. A split whose
    trainer cannot hold the training state is left out; bad inputs (lengths, a model that
    fits no server, a split with no trainer device) raise ValueError naming the field.
    """
    model, gpu = model_spec(model), gpu_spec(gpu)
    base = SimConfig(
        model=model,
        gpu=gpu,
        n_gpus=n_gpus,
        prompt_tokens=prompt_tokens,
        lengths=lengths,
        prompts_per_step=prompts_per_step,
        answers_per_prompt=answers_per_prompt,
        weight_update=weight_update,
        n_steps=n_steps,
        warmup_steps=warmup_steps,
        seed=seed,
        efficiency=efficiency,
    )
    tp = smallest_rollout_tp(model, gpu, prompt_tokens + lengths.max_new_tokens, efficiency)
    sync = simulate(replace(base, mode="sync", rollout_tp=tp))
    results = [sync]
    counts = candidate_splits(n_gpus, tp, rollout_shares) if rollout_counts is None else rollout_counts
    for n_rollout in counts:
        for eta in etas:
            cfg = replace(base, mode="async", n_rollout_gpus=n_rollout, rollout_tp=tp, eta=eta)
            try:
                results.append(simulate(cfg))
            except ValueError as err:
                if "n_trainer_gpus" not in str(err):
                    raise
                break  # this split's trainer cannot hold the model: skip its etas
    alternatives = [_alternative(r, sync.effective_throughput) for r in results]
    return sorted(alternatives, key=lambda a: -a.throughput)


def recommend(alternatives: list[Alternative], tolerance: float = 0.05) -> Alternative:
    """The best alternative; within `tolerance` of the best, the smallest eta wins (fresher
    data: in the AReaL paper's staleness ablation, its Table 2, eta <= 4 with the decoupled
    objective keeps the synchronous accuracy and larger eta loses some)."""
    best = max(a.throughput for a in alternatives)
    close = [a for a in alternatives if a.throughput >= (1 - tolerance) * best]
    return min(close, key=lambda a: (a.eta, -a.throughput))


def format_plan(alternatives: list[Alternative]) -> str:
    lines = [
        # the busy shares under the cost ledger's stage names (areal_core/run/costs.py)
        "| alternative | tokens/s | vs sync | staleness mean / max | rollout generating | trainer training |",
        "|---|---|---|---|---|---|",
    ]
    for a in alternatives:
        lines.append(
            f"| {a.label} | {a.throughput:,.0f} | {a.speedup:.2f}x | {a.staleness_mean:.2f} / {a.staleness_max} "
            f"| {a.rollout_util:.0%} | {a.trainer_util:.0%} |"
        )
    return "\n".join(lines)
