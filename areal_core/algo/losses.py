"""Token-level PPO objectives: the decoupled (AReaL) loss and the naive baseline.

Both losses share one implementation, :func:`_clipped_objective`. Per token
(with ``u = exp(logp - prox_logp)`` and ``w = exp(prox_logp - behav_logp)``)::

    loss_t = -w * min(u * A, clip(u, 1 - eps, 1 + eps) * A)

The naive loss is the special case ``prox_logp = behav_logp`` (so ``w = 1``). An off-policy
correction (``off_policy.py``, ``trainer.off_policy``) replaces ``w`` by its own weight ``c``:
truncated, or 0 for the tokens or whole sequences it drops.

Tie convention: the clipped branch is "active" only when it is *strictly*
smaller, i.e. ``A > 0 and u > 1 + eps`` or ``A < 0 and u < 1 - eps``. At the
exact boundary the unclipped branch (and its gradient ``-w * u * A``) is used.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import TYPE_CHECKING

import torch

from areal_core.algo.off_policy import off_policy_correction
from areal_core.numerics import fixed_sum

if TYPE_CHECKING:
    from areal_core.algo.off_policy import OffPolicyConfig

# keys ending in "_max" are maxima: a step takes the largest over its micro-batches (the
# others are token-weighted means)
STAT_KEYS = (
    "clip_fraction",
    "behav_weight_mean",
    "behav_weight_max",
    "approx_kl",
    "importance_weight_mean",
    "offpolicy_masked_fraction",
    "offpolicy_truncated_fraction",
    "offpolicy_ess",
    "offpolicy_weight_max",
)


def _check_inputs(logp: torch.Tensor, named: dict[str, torch.Tensor]) -> None:
    if not isinstance(logp, torch.Tensor):
        raise TypeError(f"logp must be a torch.Tensor, got {type(logp).__name__}")
    if not logp.is_floating_point():
        raise TypeError(f"logp must be a floating-point tensor, got dtype {logp.dtype}")
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != logp.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but logp has shape {tuple(logp.shape)}; "
                "all inputs must have identical shapes"
            )


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be boolean or contain only 0 and 1")
    return mask != 0


def _check_eps(eps_clip: float) -> float:
    if not isinstance(eps_clip, Real) or not math.isfinite(eps_clip) or eps_clip < 0:
        raise ValueError(f"eps_clip must be a finite number >= 0, got {eps_clip!r}")
    return float(eps_clip)


def _denominator(n_tokens, n_valid: float) -> float:
    if n_tokens is None:
        return n_valid
    if isinstance(n_tokens, torch.Tensor):
        if n_tokens.numel() != 1:
            raise ValueError(f"n_tokens must be a scalar, got shape {tuple(n_tokens.shape)}")
        n_tokens = n_tokens.item()
    if not isinstance(n_tokens, Real) or not math.isfinite(n_tokens) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a finite number >= 0, got {n_tokens!r}")
    return float(n_tokens)


def _clipped_objective(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    off_policy: OffPolicyConfig | None,
    seq_lens,
    n_tokens,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shared body of both losses; see the module docstring for the formula."""
    eps = _check_eps(eps_clip)
    valid = _as_bool_mask(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    # Padding may hold garbage (inf/nan); zero it *before* exp so that neither
    # the value nor the backward pass can produce nan at masked-out positions.
    prox = prox_logp.detach().to(logp.dtype)
    behav = behav_logp.detach().to(logp.dtype)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    log_ratio = torch.where(valid, logp - prox, zero)
    u = torch.exp(log_ratio)
    log_w = torch.where(valid, prox - behav, zero)
    w = torch.exp(log_w)
    corr = off_policy_correction(off_policy, log_w, valid, seq_lens)

    clipped = ((adv > 0) & (u > 1.0 + eps)) | ((adv < 0) & (u < 1.0 - eps))
    surrogate = torch.where(clipped, torch.clamp(u, 1.0 - eps, 1.0 + eps) * adv, u * adv)
    # a dropped token's weight is 0 itself (not only its term), so a huge w cannot give 0 * inf
    per_token = torch.where(valid & ~corr.masked, -corr.weight * surrogate, zero)

    n_valid = float(valid.sum().item())
    denom = _denominator(n_tokens, n_valid)
    total = fixed_sum(per_token)  # (a plain sum's order follows the thread count past 32k tokens)
    loss = total / denom if denom > 0 else total * 0.0

    with torch.no_grad():
        if n_valid > 0:
            vf = valid.to(logp.dtype)
            c = corr.weight * vf
            c_sq = float(fixed_sum(c * c))
            stats = {
                "clip_fraction": float((clipped & valid).sum().item()) / n_valid,
                "behav_weight_mean": float(fixed_sum(w * vf)) / n_valid,
                "behav_weight_max": float(w[valid].max().item()),
                "approx_kl": float(fixed_sum(-log_ratio)) / n_valid,
                "importance_weight_mean": float(fixed_sum(u * vf)) / n_valid,
                "offpolicy_masked_fraction": float(corr.masked.sum().item()) / n_valid,
                "offpolicy_truncated_fraction": float(corr.truncated.sum().item()) / n_valid,
                "offpolicy_ess": float(fixed_sum(c)) ** 2 / (n_valid * c_sq) if c_sq > 0 else 0.0,
                "offpolicy_weight_max": float(c[valid].max().item()),
            }
        else:
            stats = dict.fromkeys(STAT_KEYS, 0.0)
    return loss, stats


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float = 0.2,
    off_policy: OffPolicyConfig | None = None,
    n_tokens: float | int | torch.Tensor | None = None,
    seq_lens: list[int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (AReaL): clip around the proximal policy, reweight by behaviour.

    All tensors share one shape; ``mask`` is bool or 0/1. Only ``logp`` receives
    gradient (``prox_logp``, ``behav_logp`` and ``advantages`` are detached).
    ``off_policy`` (a ``trainer.off_policy`` config, None for ``none``) replaces the behaviour
    weight ``w = exp(prox - behav)`` by its correction (``off_policy.py``); the tokens it drops
    contribute 0 but still count in the denominator. The sequence-level corrections need the
    sequences: the rows of ``[batch, T]`` inputs, or ``seq_lens`` (one length per sequence) for
    packed 1-D inputs.
    The loss is ``sum(masked per-token loss) / denom`` with ``denom = n_tokens``
    if given (e.g. the global-batch token count, so micro-batch losses add up to
    the full-batch loss) else ``mask.sum()``; ``denom == 0`` gives a zero loss
    that still has a (zero) gradient.

    Stats (python floats over masked tokens, 0.0 if none):
    ``clip_fraction`` (clipped branch strictly active, so zero gradient),
    ``behav_weight_mean``/``behav_weight_max`` (of ``w``, before any correction),
    ``approx_kl`` (mean ``prox_logp - logp``), ``importance_weight_mean`` (mean
    ``u = exp(logp - prox_logp)``), and of the correction: ``offpolicy_masked_fraction`` (tokens
    dropped), ``offpolicy_truncated_fraction`` (tokens whose weight was lowered but kept),
    ``offpolicy_ess`` (``(sum c)^2 / (n * sum c^2)`` of the applied weights ``c``, dropped tokens
    as 0: 1 when all weights are equal, 0 when all are dropped) and ``offpolicy_weight_max``.
    """
    _check_inputs(
        logp,
        {"prox_logp": prox_logp, "behav_logp": behav_logp, "advantages": advantages, "mask": mask},
    )
    return _clipped_objective(logp, prox_logp, behav_logp, advantages, mask, eps_clip, off_policy, seq_lens, n_tokens)


def naive_ppo_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float = 0.2,
    n_tokens: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Standard PPO clipped around the behaviour policy (``u = exp(logp - behav_logp)``).

    Same normalisation and stats keys as :func:`decoupled_ppo_loss`, with no off-policy
    correction: the behaviour weight is identically 1 (so ``behav_weight_*``,
    ``offpolicy_ess`` and ``offpolicy_weight_max`` are 1.0 and the masked and truncated
    fractions 0.0 when any token is valid) and ``approx_kl`` is the mean of
    ``behav_logp - logp``.
    """
    _check_inputs(logp, {"behav_logp": behav_logp, "advantages": advantages, "mask": mask})
    return _clipped_objective(logp, behav_logp, behav_logp, advantages, mask, eps_clip, None, None, n_tokens)
