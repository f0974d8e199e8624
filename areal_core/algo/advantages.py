"""Critic-free advantages (gamma = lambda = 1): one scalar per trajectory.

Every token of a trajectory gets the trajectory's final reward as its return,
so the advantage is a normalised reward; broadcast it over the tokens with
:func:`expand_to_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

MODES = ("batch", "group", "none")


def _normalise(r: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - mean) / (population std + eps); exact zeros when all values are equal."""
    if r.numel() == 0 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def compute_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[Hashable] | None = None,
    mode: str = "batch",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-trajectory advantages from scalar rewards.

    ``mode="batch"``: normalise over the whole batch; ``"group"``: normalise
    within each group of answers to the same prompt (``group_ids``, one
    hashable per reward, GRPO-style); ``"none"``: rewards unchanged. The std is
    the population std. A batch/group whose rewards are all equal gives zeros.
    Returns a new 1-D tensor (float tensors keep their dtype, anything else
    becomes the default float dtype); ``group_ids`` is ignored unless
    ``mode="group"`` (its length is still checked when given).
    """
    if mode not in MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {MODES}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if isinstance(rewards, torch.Tensor):
        r = rewards.detach()
        if not r.is_floating_point():
            r = r.to(torch.get_default_dtype())
    else:
        r = torch.as_tensor(list(rewards), dtype=torch.get_default_dtype())
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one scalar per trajectory), got shape {tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite values at indices {bad[:10]}")
    if group_ids is not None and len(group_ids) != r.numel():
        raise ValueError(
            f"group_ids has {len(group_ids)} entries but there are {r.numel()} rewards; pass one group id per reward"
        )

    if mode == "none":
        return r.clone()
    if mode == "batch":
        return _normalise(r, eps)
    if group_ids is None:
        raise ValueError('mode="group" needs group_ids (one id per reward)')
    members: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    out = torch.empty_like(r)
    for idx in members.values():
        index = torch.tensor(idx, dtype=torch.long, device=r.device)
        out[index] = _normalise(r[index], eps)
    return out


def expand_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-trajectory advantages ``[batch]`` to tokens ``[batch, seq]`` (0 where masked out)."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"expected advantages [batch] and mask [batch, seq], got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    return advantages[:, None] * mask.to(advantages.dtype)
