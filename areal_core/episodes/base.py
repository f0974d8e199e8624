"""The episode interface and the built-in single-turn episode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from areal_core.reward.result import RewardResult
from areal_core.types import Trajectory


class EpisodeContext(Protocol):
    """What the controller offers an episode."""

    @property
    def version(self) -> int: ...  # the servers' policy version now

    async def generate(
        self, trajs: Sequence[Trajectory], max_new_tokens: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> None:
        """Extend each trajectory with one policy turn (up to ``max_new_tokens`` new tokens, default
        the config's), resilient to a lost server; returns when every one has finished its turn. The
        turn ends at EOS or at any of ``stop_token_ids`` (which stays in the answer, as EOS does)."""

    async def grade(self, trajs: Sequence[Trajectory], texts: Sequence[str]) -> list[RewardResult]:
        """Grade ``texts`` (one answer per trajectory) with each trajectory's task, reference and tests."""

    def room(self, traj: Trajectory) -> int | None:
        """How many more tokens ``traj`` (prompt + answer) may hold: the model's context, the trainer's
        micro-batch and the KV budget leave that much (``run/budget.py``); None: no limit.
        ``generate`` never goes past it; an episode adds environment text only where it ``fits``."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Episode(Protocol):
    async def run(self, group: list[Trajectory], ctx: EpisodeContext) -> list[RewardResult]:
        """Roll out ``group`` (fresh trajectories of one prompt); return each one's final verdict."""


def append_environment(traj: Trajectory, ids: Sequence[int], version: int) -> None:
    """Add environment text (feedback, tool output) to ``traj``'s answer: context, never trained
    (mask 0; logprob 0 and the current version as placeholders the trainer never reads); the
    trajectory is open again for the policy's next turn."""
    if not traj.output_mask:
        traj.output_mask = [1] * len(traj.output_ids)
    traj.output_ids += list(ids)
    traj.output_logprobs += [0.0] * len(ids)
    traj.output_versions += [version] * len(ids)
    traj.output_mask += [0] * len(ids)
    traj.finish_reason = ""


def fits(ctx: EpisodeContext, traj: Trajectory, ids: Sequence[int]) -> bool:
    """Whether environment text ``ids`` can join ``traj`` and still leave the policy a token to answer
    with; one that does not fit ends the answer where it is (the episode does not add it)."""
    room = ctx.room(traj)
    return room is None or len(ids) < room


def last_turn_text(traj: Trajectory, ctx: EpisodeContext) -> str:
    """The policy's latest turn: the answer after the last environment text."""
    mask = traj.output_mask or [1] * len(traj.output_ids)
    start = len(mask)
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    return ctx.decode(traj.output_ids[start:])


class SingleTurn:
    """One answer per trajectory, graded once: plain RL on prompts."""

    async def run(self, group: list[Trajectory], ctx: EpisodeContext) -> list[RewardResult]:
        await ctx.generate(group)
        return await ctx.grade(group, [ctx.decode(t.output_ids) for t in group])
