"""Held-out accuracy through the rollout protocol (any server that speaks it)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from areal_core.rollout.backend import Sampling
from areal_core.rollout.pool import RolloutPool

if TYPE_CHECKING:
    from areal_core.experiment import ExperimentConfig


def heldout_sampling(cfg: ExperimentConfig) -> Sampling:
    """How a run samples its held-out answers: at ``eval.temperature`` (0: greedy), up to
    ``eval.max_new_tokens`` (default ``rollout.sampling.max_new_tokens``) tokens, unfiltered."""
    return Sampling(
        temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens
    )


async def _generate_all(urls, prompts, sampling, timeout_s, make_client):
    pool = RolloutPool(urls, timeout_s=timeout_s, make_client=make_client)
    try:
        return await asyncio.gather(*(pool.generate(p.input_ids, sampling, rid=f"eval-{p.id}") for p in prompts))
    finally:
        await pool.aclose()


def evaluate_prompts(urls, prompts, decode, rewards, sampling: Sampling, *, timeout_s=600.0, make_client=None) -> dict:
    """Generate one answer per prompt with ``sampling``, grade them on the reward service; accuracy in
    0..1. ``make_client``: the rollout backend's client (default: the embedded engine's)."""
    responses = asyncio.run(_generate_all(urls, prompts, sampling, timeout_s, make_client))
    texts = [decode(r.output_ids) for r in responses]
    by_task: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_task.setdefault(p.task, []).append(i)
    correct = [False] * len(prompts)
    for task, idx in by_task.items():
        results = rewards.grade_many(
            task, [texts[i] for i in idx], [prompts[i].reference for i in idx], [prompts[i].tests for i in idx]
        )
        for i, r in zip(idx, results):
            correct[i] = bool(r.correct)
    lengths = [len(r.output_ids) for r in responses]
    return {
        "accuracy": sum(correct) / len(prompts),
        "n": len(prompts),
        "correct": correct,
        "lengths": lengths,
    }
