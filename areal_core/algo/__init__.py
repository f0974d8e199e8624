"""Pure algorithm pieces: PPO losses and their off-policy corrections, the staleness gate,
micro-batching, advantages, the pi_prox approximation."""

from areal_core.algo.advantages import compute_advantages, expand_to_tokens
from areal_core.algo.losses import decoupled_ppo_loss, naive_ppo_loss
from areal_core.algo.microbatch import allocate_microbatches, allocate_shared_prompt_microbatches, split_fixed
from areal_core.algo.off_policy import off_policy_correction
from areal_core.algo.prox import loglinear_prox_logp
from areal_core.algo.staleness import staleness_allows

__all__ = [
    "allocate_microbatches",
    "allocate_shared_prompt_microbatches",
    "compute_advantages",
    "decoupled_ppo_loss",
    "expand_to_tokens",
    "loglinear_prox_logp",
    "naive_ppo_loss",
    "off_policy_correction",
    "split_fixed",
    "staleness_allows",
]
