"""Proximal-policy log-probabilities without a forward pass: log-linear interpolation by version.

Decoupled PPO clips around pi_prox, the policy before this training step. With
several PPO minibatches the trainer must otherwise recompute it with a full
no-grad forward pass over the batch. AReaL's approximation ("loglinear",
``compute_prox_logp_approximations`` in ``areal/trainer/ppo/actor.py`` and
docs/en/algorithms/prox_approx.md of inclusionAI/AReaL) assumes the policy
moves along a straight line in log-probability space from version to version,
and reads pi_prox off that line between the token's behaviour policy and the
policy being optimised::

    alpha = (v_prox - v_behav) / (v_theta - v_behav), clipped to [0, 1]
            (0 where v_theta <= v_behav)
    log pi_prox ~= log pi_behav + alpha * (log pi_theta - log pi_behav)

Version labels here: a token's ``v_behav`` is the version that sampled it;
``v_prox = version`` is the policy before this step (what the exact recompute
evaluates); ``v_theta = version + 1`` is the policy this step produces, whose
current (detached) logprobs the update's own forward pass gives. So a token
from the current policy keeps its behaviour logprob (alpha = 0, exact), and one
``g`` versions old gets ``alpha = g / (g + 1)``. (AReaL labels the policy
being optimised with the pre-step version and pi_prox one below it, i.e. both
one lower; see ``prox_alpha``.)
"""

from __future__ import annotations

import torch


def prox_alpha(token_versions: torch.Tensor, prox_version: int, theta_version: int) -> torch.Tensor:
    """Interpolation weight per token: ``clip((v_prox - v_b) / (v_theta - v_b), 0, 1)``, 0 if v_theta <= v_b."""
    v = token_versions.to(torch.float64)
    diff = float(theta_version) - v
    ahead = diff > 0
    alpha = torch.where(ahead, (float(prox_version) - v) / torch.where(ahead, diff, 1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


def loglinear_prox_logp(
    behav_logp: torch.Tensor, current_logp: torch.Tensor, token_versions: torch.Tensor, version: int
) -> torch.Tensor:
    """Approximate log pi_prox per token for a training step of the policy at ``version``.

    ``behav_logp``: the sampling policy's logprobs; ``current_logp``: the policy being
    optimised (detached: no gradient flows into pi_prox); ``token_versions``: the version
    that sampled each token (integers, none above ``version``).
    """
    if behav_logp.shape != current_logp.shape or token_versions.shape != behav_logp.shape:
        raise ValueError(
            f"loglinear_prox_logp: behav_logp {tuple(behav_logp.shape)}, current_logp "
            f"{tuple(current_logp.shape)} and token_versions {tuple(token_versions.shape)} must have one shape"
        )
    if token_versions.is_floating_point():
        raise TypeError(f"loglinear_prox_logp: token_versions must be integers, got {token_versions.dtype}")
    if token_versions.numel() and int(token_versions.max()) > version:
        raise ValueError(
            f"loglinear_prox_logp: a token was sampled by version {int(token_versions.max())}, "
            f"newer than the policy being trained (version {version})"
        )
    alpha = prox_alpha(token_versions, prox_version=version, theta_version=version + 1).to(behav_logp.dtype)
    current = current_logp.detach()
    return behav_logp + alpha * (current - behav_logp)
