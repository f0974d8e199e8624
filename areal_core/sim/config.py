"""What one simulated run is given: `SimConfig`, and `resolve`, which validates it and
derives the `Setup` the event loop runs with (the model and GPU specs, the rollout tensor
parallelism, the rollout:trainer split, the server count and the cost model).

Every invalid setting is a ValueError that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WeightUpdateMode, weight_update_mode
from areal_core.sim.cost import (
    CostModel,
    Efficiency,
    build_cost_model,
    check_rollout_fits,
    check_trainer_fits,
    smallest_rollout_tp,
)
from areal_core.sim.hardware import GPUSpec, ModelSpec, gpu_spec, model_spec
from areal_core.sim.lengths import LengthDist

MODES = ("async", "sync")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Counts are devices (GPUs); lengths are tokens.

    Attributes:
        model: a `ModelSpec` or a preset name ("1.5B", "7B", "32B").
        gpu: a `GPUSpec` or a preset name ("H800", "H100", "A100", "H200").
        n_gpus: devices in all.
        mode: "async" (devices split between rollout and trainer) or "sync".
        n_rollout_gpus: async: devices serving (default: 3/4 of n_gpus, AReaL's split).
        rollout_tp: devices per rollout server (default: the fewest that hold the model
            and one full-length sequence).
        eta: maximum staleness (async; sync is eta 0 by construction).
        weight_update: what an update does to answers in flight: reprefill, keep_kv, drain.
        prompts_per_step: prompts per training batch.
        answers_per_prompt: answers per prompt (a group; admitted and trained whole).
        prompt_tokens: prompt length.
        lengths: the answer-length distribution (clipped at its max_new_tokens).
        n_steps: training steps to simulate.
        warmup_steps: steps left out of the effective throughput (pipeline fill).
        seed: seeds the answer lengths (the same seed gives the same lengths in
            admission order, whatever the mode).
        efficiency: achieved fractions and overheads for the roofline cost model.
        cost: a ready `CostModel` (e.g. from `calibrate_from`) used instead of the roofline.
        max_running_per_server: continuous-batching cap on running requests per server.
        admit_reserve_tokens: KV a server keeps free per running request when admitting.
        util_bins: points in the utilisation time series.
        train_shared_prompt: the trainer computes a group's prompt once (this project's
            trainer does; AReaL's packs every answer with its own copy): the training
            cost's token count holds each group's prompt once. The trained-token
            throughput counts it per answer either way.
    """

    model: ModelSpec | str = "7B"
    gpu: GPUSpec | str = "H800"
    n_gpus: int = 64
    mode: str = "async"
    n_rollout_gpus: int | None = None
    rollout_tp: int | None = None
    eta: int = 4
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE
    prompts_per_step: int = 512
    answers_per_prompt: int = 16
    prompt_tokens: int = 1024
    lengths: LengthDist = field(default_factory=lambda: LengthDist(max_new_tokens=15360, median=4000, sigma=0.9))
    n_steps: int = 20
    warmup_steps: int = 5
    seed: int = 0
    efficiency: Efficiency = field(default_factory=Efficiency)
    cost: CostModel | None = None
    max_running_per_server: int = 1024
    admit_reserve_tokens: int = 512
    util_bins: int = 100
    train_shared_prompt: bool = False

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.answers_per_prompt


@dataclass(frozen=True)
class Setup:
    """A validated `SimConfig` with everything derived from it."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int
    n_rollout_gpus: int
    n_trainer_gpus: int
    n_servers: int
    cost: CostModel


def resolve(cfg: SimConfig) -> Setup:
    """Validate `cfg`; every error is a ValueError that names the field."""
    if cfg.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    weight_update_mode(cfg.weight_update)
    for name in ("n_gpus", "prompts_per_step", "answers_per_prompt", "n_steps", "max_running_per_server", "util_bins"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("eta", "prompt_tokens", "warmup_steps", "admit_reserve_tokens"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.warmup_steps >= cfg.n_steps:
        raise ValueError(f"warmup_steps must be < n_steps ({cfg.n_steps}), got {cfg.warmup_steps}")
    if not isinstance(cfg.lengths, LengthDist):
        raise ValueError(f"lengths must be a LengthDist, got {type(cfg.lengths).__name__}")
    model, gpu = model_spec(cfg.model), gpu_spec(cfg.gpu)
    seq_tokens = cfg.prompt_tokens + cfg.lengths.max_new_tokens
    if cfg.rollout_tp is None:
        tp = smallest_rollout_tp(model, gpu, seq_tokens, cfg.efficiency)
    elif cfg.rollout_tp < 1:
        raise ValueError(f"rollout_tp must be >= 1, got {cfg.rollout_tp}")
    else:
        tp = cfg.rollout_tp
    if cfg.mode == "sync":
        n_rollout, n_trainer = cfg.n_gpus, cfg.n_gpus
        if cfg.n_gpus % tp:
            raise ValueError(f"n_gpus ({cfg.n_gpus}) must be a multiple of rollout_tp ({tp}) in sync mode")
    else:
        n_rollout = cfg.n_rollout_gpus if cfg.n_rollout_gpus is not None else _default_rollout(cfg.n_gpus, tp)
        if n_rollout >= cfg.n_gpus:
            raise ValueError(
                f"n_rollout_gpus: {n_rollout} of n_gpus {cfg.n_gpus} leaves no trainer device (async needs both)"
            )
        if n_rollout < tp:
            raise ValueError(
                f"n_rollout_gpus: {n_rollout} leaves no rollout server (one needs rollout_tp = {tp} devices)"
            )
        if n_rollout % tp:
            raise ValueError(f"n_rollout_gpus ({n_rollout}) must be a multiple of rollout_tp ({tp})")
        n_trainer = cfg.n_gpus - n_rollout
    check_rollout_fits(model, gpu, tp, seq_tokens, cfg.efficiency)
    check_trainer_fits(
        model, gpu, n_trainer, cfg.efficiency, field="n_gpus" if cfg.mode == "sync" else "n_trainer_gpus"
    )
    switch_devices = cfg.n_gpus if cfg.mode == "sync" else 0
    cost = cfg.cost or build_cost_model(model, gpu, tp, cfg.efficiency, train_devices_for_switch=switch_devices)
    if cost.kv_capacity_tokens < seq_tokens:
        raise ValueError(
            f"cost.kv_capacity_tokens ({cost.kv_capacity_tokens}) is below one full sequence "
            f"(prompt_tokens + lengths.max_new_tokens = {seq_tokens})"
        )
    return Setup(model, gpu, tp, n_rollout, n_trainer, n_rollout // tp, cost)


def _default_rollout(n_gpus: int, tp: int) -> int:
    n = (3 * n_gpus // 4) // tp * tp
    return max(n, tp)
