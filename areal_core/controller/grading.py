"""Grading a group's answers: one batch of reward tasks on the Dask reward service, its results
brought back to the controller's event loop, and the verdict each answer's reward follows from."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from areal_core.aio import settle_threadsafe
from areal_core.controller.settings import ControllerSettings, prompt_of
from areal_core.reward.result import RewardResult
from areal_core.reward.service import RewardService
from areal_core.types import Prompt, Trajectory


class Grader:
    """``rewards``: the reward service; ``prompts``: the run's prompts (code answers are graded
    against their prompt's tests); rewards follow ``settings.reward_correct`` / ``reward_wrong``."""

    def __init__(self, rewards: RewardService, prompts: Sequence[Prompt], settings: ControllerSettings):
        self.rewards, self.s = rewards, settings
        self._tests = {p.id: p.tests for p in prompts if p.tests}  # what code answers are graded against

    def grade(
        self, trajs: Sequence[Trajectory], texts: Sequence[str], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future:
        """Grade ``texts`` (one answer per trajectory of one group) as one batch of reward tasks; a
        future of ``loop`` with their results, in order."""
        tests = self._tests.get(prompt_of(trajs[0].group_id))  # one group, one prompt (and one list of tests)
        items = [(t.task, x, t.reference, tests) for t, x in zip(trajs, texts, strict=True)]
        fut = loop.create_future()

        def deliver(results, error) -> None:  # on a Dask client thread (a controller stopped meanwhile: dropped)
            settle_threadsafe(fut, None if error is not None else list(results), error)

        self.rewards.submit_batch(items, on_done=deliver)
        return fut

    def verdict(self, traj: Trajectory, result: RewardResult) -> None:
        """Record ``result`` on ``traj``: whether it is right, its reward and the grader's notes."""
        traj.correct = bool(result.correct)  # for code: every test passed
        # reward_correct or reward_wrong; with partial credit (code under ``reward.code_reward: fraction``)
        # the result's score of the way from reward_wrong to reward_correct
        lo, hi = self.s.reward_wrong, self.s.reward_correct
        traj.reward = (hi if result.correct else lo) if result.score is None else lo + result.score * (hi - lo)
        traj.reward_info = {**traj.reward_info, **result.as_dict()}  # an episode's notes (turns) stay
        versions = traj.policy_token_versions()
        traj.policy_version = min(versions) if versions else None  # the oldest that sampled a token
