"""What the run loop needs of a trainer: :class:`TrainEngine`, and what one step returns, :class:`StepResult`.

Two trainers implement it: ``trainer.Trainer`` (torch, this process) and
``trainer.megatron.trainer.MegatronTrainer`` (megatron-core, rank 0 of a job); ``make_trainer`` picks
one by ``trainer.backend`` (``trainer/backends.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from areal_core.types import Trajectory


@dataclass(frozen=True)
class StepResult:
    """One training step: the figures the run loop acts on, typed, and every figure for metrics.parquet."""

    metrics: dict[str, float | int | str]
    """Every per-step figure (loss, clip fraction, grad norm, lr, reward, accuracy, staleness, answer
    lengths, passes, times): the training columns of the step's metrics row."""
    prox_version: int | None
    """The proximal policy's version (the weights the step started from), as the ledger records it;
    None for naive PPO, which has none."""
    tokens_trained: int  # policy tokens the step's loss covered
    accuracy: float  # the batch's share of correct answers
    reward: float  # the batch's mean reward
    staleness_max: int  # the oldest trained token's age in versions
    answer_len_mean: float  # the batch's mean answer length, in tokens

    @classmethod
    def of(cls, metrics: dict, version: int) -> StepResult:
        """From a trainer's figures for a step by the policy at ``version``."""
        return cls(
            metrics,
            None if metrics["prox_logp_path"] == "none" else version,
            tokens_trained=int(metrics["tokens_trained"]),
            accuracy=float(metrics["accuracy"]),
            reward=float(metrics["reward"]),
            staleness_max=int(metrics["staleness_max"]),
            answer_len_mean=float(metrics["answer_len_mean"]),
        )


class TrainEngine(Protocol):
    """A trainer as the run loop uses it: one PPO step per batch, and its state to checkpoint and resume."""

    def step(self, batch: list[Trajectory], version: int) -> StepResult:
        """One training step on ``batch`` by the policy at ``version``; the model's weights are then
        ``version + 1``'s."""

    def state_dict(self) -> dict:
        """Everything a resume needs: master weights, optimizer moments, lr schedule."""

    def load_state_dict(self, state: dict) -> None: ...

    def adopt_moments(self, moments: dict[str, dict[str, torch.Tensor]]) -> int:
        """Start AdamW from earlier moments keyed by parameter name; how many were taken."""
