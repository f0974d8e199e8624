"""The parts of a PPO step that do not depend on how the model is run, shared by the torch
trainer (``trainer.py``) and the megatron one (``megatron/engine.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_core.algo import compute_advantages, decoupled_ppo_loss, loglinear_prox_logp, naive_ppo_loss
from areal_core.numerics import fixed_sum
from areal_core.trainer.config import TrainerConfig
from areal_core.types import Trajectory


@dataclass
class PreparedBatch:
    seqs: list[list[int]]  # prompt + answer
    starts: list[int]  # where each answer starts
    n_out: list[int]  # answer lengths
    rewards: torch.Tensor  # [B]
    behav: list[torch.Tensor]  # behaviour logprobs, per trajectory
    adv: list[torch.Tensor]  # advantages per answer token, per trajectory
    mask: list[torch.Tensor]  # bool per answer token: the policy's own (trained) or environment text
    n_trained: list[int]  # policy tokens per trajectory: what the loss averages over
    versions: list[torch.Tensor]  # the version that sampled each answer token, per trajectory


def trained_mask(t: Trajectory) -> torch.Tensor:
    """Which of ``t``'s output tokens the loss sees (``Trajectory.output_mask``; empty: all)."""
    if not t.output_mask:
        return torch.ones(len(t.output_ids), dtype=torch.bool)
    if len(t.output_mask) != len(t.output_ids) or any(m not in (0, 1) for m in t.output_mask):
        raise ValueError(
            f"trajectory {t.traj_id}: output_mask must hold one 0 or 1 per output token "
            f"({len(t.output_ids)}), got {len(t.output_mask)} values"
        )
    if not any(t.output_mask):
        raise ValueError(f"trajectory {t.traj_id}: output_mask trains no token (all 0)")
    return torch.tensor(t.output_mask, dtype=torch.bool)


def prepare_batch(batch: list[Trajectory], adv_norm: str) -> PreparedBatch:
    """Check the trajectories and compute what every step needs from them."""
    for t in batch:
        if not t.output_ids:
            raise ValueError(f"trajectory {t.traj_id} has no output tokens")
        if len(t.output_logprobs) != len(t.output_ids) or len(t.output_versions) != len(t.output_ids):
            raise ValueError(f"trajectory {t.traj_id}: tokens, logprobs and versions differ in length")
    n_out = [len(t.output_ids) for t in batch]
    mask = [trained_mask(t) for t in batch]
    rewards = torch.tensor([float(t.reward) for t in batch])
    adv_seq = compute_advantages(rewards, [t.group_id for t in batch], mode=adv_norm)
    return PreparedBatch(
        seqs=[t.prompt_ids + t.output_ids for t in batch],
        starts=[len(t.prompt_ids) for t in batch],
        n_out=n_out,
        rewards=rewards,
        behav=[torch.tensor(t.output_logprobs, dtype=torch.float32) for t in batch],
        adv=[torch.full((n,), float(a)) for n, a in zip(n_out, adv_seq.tolist())],
        mask=mask,
        n_trained=[int(m.sum()) for m in mask],
        versions=[torch.tensor(t.output_versions) for t in batch],
    )


def prox_path(cfg: TrainerConfig, n_minibatches: int) -> str:
    """How a step gets pi_prox: "none" (naive objective), "current_forward" (one minibatch: the
    update's own forward, detached), "recompute" or "loglinear" (``trainer.prox_logp``)."""
    if cfg.objective == "naive":
        return "none"
    return "current_forward" if n_minibatches == 1 else cfg.prox_logp


def ppo_loss(
    cfg: TrainerConfig,
    path: str,
    logp: torch.Tensor,
    prep: PreparedBatch,
    idx: list[int],
    *,
    prox: dict | list | None,
    versions: list[torch.Tensor] | None,
    version: int,
    n_tokens: int,
):
    """The configured objective's loss and stats on the micro-batch ``idx`` (``logp``: its answer
    tokens' logprobs by the policy being updated, in order); environment tokens are masked out and
    ``n_tokens`` counts the minibatch's policy tokens."""
    b = torch.cat([prep.behav[i] for i in idx]).to(logp.device)
    a = torch.cat([prep.adv[i] for i in idx]).to(logp.device)
    mask = torch.cat([prep.mask[i] for i in idx]).to(logp.device)
    if cfg.objective == "naive":
        return naive_ppo_loss(logp, b, a, mask, cfg.eps_clip, n_tokens=n_tokens)
    if path == "recompute":
        p = torch.cat([prox[i] for i in idx])
    elif path == "loglinear":
        p = loglinear_prox_logp(b, logp.detach(), torch.cat([versions[i] for i in idx]).to(logp.device), version)
    else:  # one minibatch: the weights before this step are the ones of this forward
        p = logp.detach()
    # logp holds the answers of idx one after another: the sequences of the off-policy correction
    loss, stats = decoupled_ppo_loss(
        logp, p, b, a, mask, cfg.eps_clip, cfg.off_policy, n_tokens=n_tokens, seq_lens=[prep.n_out[i] for i in idx]
    )
    if path in ("recompute", "current_forward"):  # p: the weights before this step, exactly
        stats.update(logprob_gap(p, b, mask & (torch.cat([prep.versions[i] for i in idx]).to(mask.device) == version)))
    return loss, stats


def logprob_gap(trainer_logp: torch.Tensor, behav: torch.Tensor, same_version: torch.Tensor) -> dict:
    """Engine against trainer at the behaviour version: over the policy tokens the servers sampled
    with the weights the trainer holds now (``same_version``), ``|trainer logprob - engine logprob|``
    measures the numerics mismatch alone, apart from staleness. As sums (``*_sum`` keys add up over
    a step's micro-batches; the trainer reports the mean, ``logprob_gap_mean``)."""
    gap = (trainer_logp.detach().double() - behav.double()).abs()[same_version]
    return {
        "logprob_gap_sum": float(fixed_sum(gap)),
        "logprob_gap_tokens_sum": float(gap.numel()),
        "logprob_gap_max": float(gap.max()) if gap.numel() else 0.0,
    }


def batch_stats(batch: list[Trajectory], prep: PreparedBatch, version: int) -> dict:
    """Reward, accuracy, answer lengths and staleness of a step's batch."""
    staleness = torch.tensor(
        [version - v for t, m in zip(batch, prep.mask) for v, trained in zip(t.output_versions, m.tolist()) if trained],
        dtype=torch.float32,
    )
    n = torch.tensor(prep.n_out, dtype=torch.float32)
    return {
        "reward": float(prep.rewards.mean()),
        "accuracy": sum(bool(t.correct) for t in batch) / len(batch),
        "answer_len_mean": float(n.mean()),
        "answer_len_p50": float(n.quantile(0.5)),
        "answer_len_p90": float(n.quantile(0.9)),
        "answer_len_max": float(n.max()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": int(staleness.max()),
        "tokens_trained": int(sum(prep.n_trained)),
    }
