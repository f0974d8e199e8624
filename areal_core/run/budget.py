"""How long a trajectory (prompt + answer, environment text included) may grow, and the checks
at start that the first turn fits.

Three limits bound one trajectory, and ``trajectory_token_limit`` is the smallest of those that
apply:

* the model's context (``max_position_embeddings``; vLLM's ``max_model_len`` if set lower): a
  server refuses a request whose prompt + max_new_tokens exceeds it;
* ``trainer.max_tokens_per_microbatch`` under dynamic micro-batching: a trajectory is never split,
  so a longer one would fail a training step mid-run;
* the servers' KV budget (``rollout.kv_budget``, in tokens or in bytes, which each server converts
  at its model's size per position and reports): a request reserving more KV positions than the
  whole budget is refused.

The controller clamps every request's max_new_tokens to what the limit leaves of its trajectory,
so a multi-turn answer (retry, tool, openai_agent) stops growing there, and an episode adds
environment text only where it still leaves the policy a token (``episodes.base.fits``).
``check_trajectory_budget`` checks at start that the longest prompt's first turn fits whole.
"""

from __future__ import annotations

import dataclasses

from areal_core.experiment import ConfigError, ExperimentConfig
from areal_core.rollout.backend import server_infos


def trajectory_token_limit(
    cfg: ExperimentConfig, model_context: int | None, servers_kv_tokens: int | None = None
) -> int | None:
    """The most tokens one trajectory may hold (``model_context``: the model's positions, None if
    unknown; ``servers_kv_tokens``: the smallest KV budget the servers report, :func:`servers_kv_budget`);
    None: no limit applies."""
    limits = [model_context, servers_kv_tokens]
    backend = cfg.rollout.backend
    if backend.kind == "vllm":
        limits.append(backend.max_model_len)
    if cfg.trainer.microbatching == "dynamic":
        limits.append(cfg.trainer.max_tokens_per_microbatch)
    kv = cfg.rollout.kv_budget
    if kv is not None and kv.tokens is not None:
        limits.append(kv.tokens)
    known = [n for n in limits if n]
    return min(known) if known else None


def servers_kv_budget(urls: list[str], make_client) -> int | None:
    """The smallest KV budget (in positions) the servers at ``urls`` report; None where none says."""
    said = [i.kv_budget_tokens for i in server_infos(urls, make_client) if i.kv_budget_tokens is not None]
    return min(said) if said else None


def first_turn_tokens(cfg: ExperimentConfig) -> int:
    """New tokens of an answer's first turn at most: a multi-turn episode's per-turn limit (later
    turns are clamped to what is left of the trajectory), else ``rollout.sampling.max_new_tokens``."""
    ep, max_new = cfg.episode, cfg.rollout.sampling.max_new_tokens
    per_turn = getattr(ep, "max_new_tokens_per_turn", None) or getattr(ep, "max_new_tokens_per_call", None)
    return min(per_turn, max_new) if per_turn else max_new


def check_trajectory_budget(cfg: ExperimentConfig, prompts: list) -> None:
    """Dynamic micro-batching trains a trajectory in one micro-batch: the longest prompt's first turn
    (prompt + its max new tokens) must fit ``trainer.max_tokens_per_microbatch`` (else answers would be
    cut short from the start). What later turns of a multi-turn episode add is clamped to the budget."""
    t, max_new = cfg.trainer, first_turn_tokens(cfg)
    if t.microbatching != "dynamic" or not prompts:
        return
    longest = max(prompts, key=lambda p: len(p.input_ids))
    need = len(longest.input_ids) + max_new
    if need > t.max_tokens_per_microbatch:
        what = (
            "rollout.sampling.max_new_tokens"
            if max_new == cfg.rollout.sampling.max_new_tokens
            else "the episode's new tokens per turn"
        )
        raise ConfigError(
            f"trainer.max_tokens_per_microbatch ({t.max_tokens_per_microbatch}) is too small for record "
            f"{longest.id!r}: its prompt of {len(longest.input_ids)} tokens + {what} "
            f"({max_new}) = {need} tokens; raise it to at least {need} or shorten the answers"
        )


def check_agent_budget(cfg: ExperimentConfig, prompts: list, prompter) -> None:
    """``check_trajectory_budget`` for every agent's prompts (its prefix makes them longer)."""
    if cfg.multi_agent is None or not prompts:
        return
    longest = max(prompts, key=lambda p: len(p.input_ids))
    for a in cfg.multi_agent.agents:
        check_trajectory_budget(cfg, [dataclasses.replace(longest, input_ids=prompter(a.id, longest))])
