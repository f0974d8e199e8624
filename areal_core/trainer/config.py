from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_core.configbase import Section


class OptimConfig(Section):
    lr: float = Field(2e-5, gt=0)
    lr_schedule: Literal["constant", "linear"] = "linear"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.05, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-5, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    # start AdamW from the tiny model's warm-start moments instead of zeros (see Trainer.adopt_moments)
    continue_warm_start: bool = False


class TrainerConfig(Section):
    batch_size: int = Field(128, gt=0)  # B: trajectories per training step
    eta: int = Field(4, ge=0)  # max staleness; 0 = synchronous
    max_steps: int = Field(100, gt=0)
    objective: Literal["decoupled", "naive"] = "decoupled"
    eps_clip: float = Field(0.2, gt=0, lt=1)
    behav_weight_cap: float | None = Field(None, gt=1)
    reward_correct: float = 5.0
    reward_wrong: float = -5.0
    adv_norm: Literal["batch", "group", "none"] = "batch"
    ppo_minibatches: int = Field(1, gt=0)
    microbatching: Literal["dynamic", "fixed"] = "dynamic"
    max_tokens_per_microbatch: int = Field(4096, gt=0)  # dynamic
    n_microbatches: int = Field(4, gt=0)  # fixed
    warmup_steps_for_throughput: int = Field(2, ge=0)  # excluded from effective throughput
    optim: OptimConfig = OptimConfig()
    torch_threads: int = Field(1, gt=0)
