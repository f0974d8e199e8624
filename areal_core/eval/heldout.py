"""Held-out accuracy through the rollout protocol (any server that speaks it)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends import default_client
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.pool import RolloutPool

if TYPE_CHECKING:
    from areal_core.experiment import ExperimentConfig

log = logging.getLogger(__name__)


def heldout_sampling(cfg: ExperimentConfig) -> Sampling:
    """How a run samples its held-out answers: at ``eval.temperature`` (0: greedy), up to
    ``eval.max_new_tokens`` (default ``rollout.sampling.max_new_tokens``) tokens, unfiltered."""
    return Sampling(
        temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens
    )


async def _answer(pool: RolloutPool, prompt, sampling: Sampling):
    """One held-out answer. A server that is down (unreachable, or its engine stopped) leaves this
    evaluation's service and the prompt goes to another: a server lost as a run ends (killed, or still
    being restarted) does not fail the evaluation while another one answers; with none left, the error."""
    while True:
        try:
            return await pool.generate(prompt.input_ids, sampling, rid=f"eval-{prompt.id}")
        except RolloutServerError as e:
            if not e.server_down or e.url not in pool.urls:
                raise
            i = pool.index(e.url)
            if not pool.held[i]:
                pool.hold(i)
                log.warning("held-out evaluation: %s; its prompts go to the other servers", e)
            if all(pool.held):
                raise


async def _generate_all(urls, prompts, sampling, timeout_s, make_client):
    pool = RolloutPool(urls, make_client or default_client, timeout_s=timeout_s)
    try:
        return await asyncio.gather(*(_answer(pool, p, sampling) for p in prompts))
    finally:
        await pool.aclose()


def evaluate_prompts(urls, prompts, decode, rewards, sampling: Sampling, *, timeout_s=600.0, make_client=None) -> dict:
    """Generate one answer per prompt with ``sampling``, grade them on the reward service; accuracy in
    0..1, and apart from it the share of answers that state one in a form the grader reads (``answered``:
    format, right or wrong). ``make_client``: the rollout backend's client (default: the embedded engine's)."""
    responses = asyncio.run(_generate_all(urls, prompts, sampling, timeout_s, make_client))
    texts = [decode(r.output_ids) for r in responses]
    by_task: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_task.setdefault(p.task, []).append(i)
    correct = [False] * len(prompts)
    answered = [False] * len(prompts)  # an answer stated in a form the grader reads (right or wrong)
    for task, idx in by_task.items():
        results = rewards.grade_many(
            task, [texts[i] for i in idx], [prompts[i].reference for i in idx], [prompts[i].tests for i in idx]
        )
        for i, r in zip(idx, results):
            correct[i], answered[i] = bool(r.correct), r.parsed is not None
    lengths = [len(r.output_ids) for r in responses]
    return {
        "accuracy": sum(correct) / len(prompts),
        "answered": sum(answered) / len(prompts),
        "n": len(prompts),
        "correct": correct,
        "lengths": lengths,
    }
