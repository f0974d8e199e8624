"""A run's held-out evaluations: before RL, after it, and per agent in multi-agent runs."""

from __future__ import annotations

import dataclasses
import logging

from areal_core.controller.agents import agent_prompter
from areal_core.eval.heldout import evaluate_prompts, heldout_sampling
from areal_core.rollout.backend import server_infos
from areal_core.run.parts import Policy, Pools, RunSetup

log = logging.getLogger(__name__)


def heldout(run: RunSetup, policy: Policy, pools: Pools, urls: list[str], prompts: list | None = None) -> dict:
    """Held-out accuracy on ``urls`` (the evaluation prompts unless ``prompts``)."""
    sampling, timeout = heldout_sampling(run.cfg), run.cfg.rollout.request_timeout_s
    prompts = policy.eval_prompts if prompts is None else prompts
    return evaluate_prompts(
        urls, prompts, policy.decode, pools.rewards, sampling, timeout_s=timeout, make_client=pools.backend.client
    )


def per_agent_accuracy(run: RunSetup, policy: Policy, pools: Pools, urls: list[str]) -> dict:
    """Held-out accuracy with each agent's prefix, on the trainable policy."""
    agents = run.cfg.multi_agent.agents
    ask = agent_prompter(agents, policy.eval_records, policy.tokenizer)
    return {
        a.id: heldout(
            run, policy, pools, urls, [dataclasses.replace(p, input_ids=ask(a.id, p)) for p in policy.eval_prompts]
        )["accuracy"]
        for a in agents
    }


def heldout_before(run: RunSetup, policy: Policy, pools: Pools) -> dict:
    run.phase(f"held-out accuracy before RL, on {len(policy.eval_prompts)} problems")
    before = heldout(run, policy, pools, pools.urls)
    ma = run.cfg.multi_agent
    if ma is not None and ma.eval_per_agent:
        before["per_agent"] = per_agent_accuracy(run, policy, pools, pools.urls)
    log.info("held-out accuracy before RL: %.3f", before["accuracy"])
    return before


def heldout_after(run: RunSetup, policy: Policy, pools: Pools, controller, before: dict) -> tuple[dict, dict | None]:
    """Held-out accuracy after RL on the servers left (an elastic pool may have lost some), and a
    multi-agent run's routing summary."""
    run.phase(f"held-out accuracy after RL, on {len(policy.eval_prompts)} problems")
    urls = controller.live_urls()
    after = heldout(run, policy, pools, urls)
    if policy.agents is None:
        return after, None
    multi_agent = {
        **policy.agents.summary(),
        "frozen_answers": controller.frozen_generated,
        # what the frozen server reports now: its version never moved
        "frozen_server_versions": _weight_versions(pools.frozen_urls, pools.backend.client),
    }
    if run.cfg.multi_agent.eval_per_agent:
        run.phase(f"held-out accuracy after RL with each agent's prefix, on {len(policy.eval_prompts)} problems")
        multi_agent["per_agent_eval"] = {
            a: {"before": before.get("per_agent", {}).get(a), "after": acc}
            for a, acc in per_agent_accuracy(run, policy, pools, urls).items()
        }
    return after, multi_agent


def _weight_versions(urls: list[str], make_client) -> list[int]:
    """The weight version each server reports."""

    return [i.weight_version for i in server_infos(urls, make_client)]
