"""What one simulated run gives: `SimResult`, and `collect_result`, which turns the event
loop's records (step end times, trained tokens, busy intervals, staleness) into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areal_core.rollout.backend import WeightUpdateMode
from areal_core.sim.config import Setup, SimConfig
from areal_core.sim.server import RolloutServer


@dataclass
class SimResult:
    """What one simulated run gives.

    Attributes:
        mode, eta, weight_update, n_rollout_gpus, n_trainer_gpus, rollout_tp: the setting.
        wall_time_s: time at which the last step's training ended.
        step_end_s: end time of every training step.
        step_train_s: how long each step's training took (its trainer time).
        trained_tokens: prompt + answer tokens trained over the run.
        effective_throughput: trained tokens/s over the steps after `warmup_steps`.
        effective_answer_throughput: the same counting answer tokens only (what the
            project's `effective_train_tokens_per_s` counts).
        overall_throughput: trained tokens / wall time.
        generation_throughput: answer tokens generated / wall time (all servers).
        staleness: per trained answer, the trainer's version minus the version of the
            answer's oldest token.
        util_t: bin centres of the utilisation series (s).
        rollout_busy: share of rollout devices generating (decode or prefill), per bin.
        trainer_busy: share of trainer devices training, per bin.
        n_weight_updates: versions published to the servers.
        n_retracted: requests pushed back to a queue because the KV cache was full.
    """

    mode: str
    eta: int
    weight_update: WeightUpdateMode
    n_rollout_gpus: int
    n_trainer_gpus: int
    rollout_tp: int
    wall_time_s: float
    step_end_s: np.ndarray
    step_train_s: np.ndarray
    trained_tokens: int
    effective_throughput: float
    effective_answer_throughput: float
    overall_throughput: float
    generation_throughput: float
    staleness: np.ndarray
    util_t: np.ndarray
    rollout_busy: np.ndarray
    trainer_busy: np.ndarray
    n_weight_updates: int
    n_retracted: int

    @property
    def staleness_mean(self) -> float:
        return float(self.staleness.mean()) if self.staleness.size else 0.0

    @property
    def staleness_max(self) -> int:
        return int(self.staleness.max()) if self.staleness.size else 0

    def staleness_histogram(self) -> dict[int, int]:
        values, counts = np.unique(self.staleness, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}

    @property
    def rollout_util(self) -> float:
        return float(self.rollout_busy.mean())

    @property
    def trainer_util(self) -> float:
        return float(self.trainer_busy.mean())

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "eta": self.eta,
            "weight_update": self.weight_update,
            "n_rollout_gpus": self.n_rollout_gpus,
            "n_trainer_gpus": self.n_trainer_gpus,
            "rollout_tp": self.rollout_tp,
            "wall_time_s": round(self.wall_time_s, 2),
            "effective_throughput": round(self.effective_throughput, 1),
            "effective_answer_throughput": round(self.effective_answer_throughput, 1),
            "generation_throughput": round(self.generation_throughput, 1),
            "staleness_mean": round(self.staleness_mean, 3),
            "staleness_max": self.staleness_max,
            "rollout_util": round(self.rollout_util, 3),
            "trainer_util": round(self.trainer_util, 3),
        }


def collect_result(
    cfg: SimConfig,
    setup: Setup,
    servers: list[RolloutServer],
    step_end: list[float],
    step_tokens: list[int],
    step_answer_tokens: list[int],
    train_intervals: list[tuple[float, float]],
    staleness: list[np.ndarray],
    n_updates: int,
) -> SimResult:
    """The `SimResult` of a finished run.

    Args:
        cfg, setup: the run's configuration and what `resolve` derived from it.
        servers: the rollout servers, with their busy intervals and counters.
        step_end: end time of every training step.
        step_tokens: prompt + answer tokens trained per step.
        step_answer_tokens: answer tokens trained per step.
        train_intervals: (start, end) of every step's training.
        staleness: per step, the staleness of each trained answer.
        n_updates: versions published to the servers.
    """
    wall = step_end[-1]
    ends = np.asarray(step_end)
    tokens = np.asarray(step_tokens, dtype=np.float64)
    w = cfg.warmup_steps
    t0 = ends[w - 1] if w > 0 else 0.0
    effective = tokens[w:].sum() / (ends[-1] - t0)
    answers = np.asarray(step_answer_tokens, dtype=np.float64)
    edges = np.linspace(0.0, wall, cfg.util_bins + 1)
    rollout = np.zeros(cfg.util_bins)
    for server in servers:
        rollout += server.tp * _busy_per_bin(server.busy, edges)
    rollout /= setup.n_rollout_gpus * np.diff(edges)
    trainer = _busy_per_bin(train_intervals, edges) / np.diff(edges)
    return SimResult(
        mode=cfg.mode,
        eta=cfg.eta if cfg.mode == "async" else 0,
        weight_update=cfg.weight_update if cfg.mode == "async" else "drain",
        n_rollout_gpus=setup.n_rollout_gpus,
        n_trainer_gpus=setup.n_trainer_gpus,
        rollout_tp=setup.tp,
        wall_time_s=float(wall),
        step_end_s=ends,
        step_train_s=np.array([b - a for a, b in train_intervals]),
        trained_tokens=int(tokens.sum()),
        effective_throughput=float(effective),
        effective_answer_throughput=float(answers[w:].sum() / (ends[-1] - t0)),
        overall_throughput=float(tokens.sum() / wall),
        generation_throughput=float(sum(s.generated_tokens for s in servers) / wall),
        staleness=np.concatenate(staleness) if staleness else np.zeros(0, dtype=np.int64),
        util_t=(edges[:-1] + edges[1:]) / 2,
        rollout_busy=np.clip(rollout, 0.0, 1.0),
        trainer_busy=np.clip(trainer, 0.0, 1.0),
        n_weight_updates=n_updates,
        n_retracted=sum(s.retracted for s in servers),
    )


def _busy_per_bin(intervals, edges: np.ndarray) -> np.ndarray:
    """Busy seconds of a set of disjoint intervals in each bin."""
    if not intervals:
        return np.zeros(len(edges) - 1)
    arr = np.asarray(intervals, dtype=np.float64)
    start, length = arr[:, 0], arr[:, 1] - arr[:, 0]
    covered = np.clip(edges[:, None] - start[None, :], 0.0, length[None, :]).sum(axis=1)
    return np.diff(covered)
