"""What an episode may do with the rollout controller (``episodes.EpisodeContext``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from areal_core.reward.result import RewardResult
from areal_core.types import Trajectory

if TYPE_CHECKING:
    from areal_core.controller.core import RolloutController


class EpisodeContextOf:
    """What an episode may do with the controller (``episodes.EpisodeContext``)."""

    def __init__(self, controller: RolloutController):
        self._c = controller

    @property
    def version(self) -> int:
        return self._c.version

    async def generate(
        self, trajs: Sequence[Trajectory], max_new_tokens: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> None:
        await self._c.generator.turn(trajs, max_new_tokens, stop_token_ids)

    async def grade(self, trajs: Sequence[Trajectory], texts: Sequence[str]) -> list[RewardResult]:
        return await self._c._grade(trajs, texts)

    def room(self, traj: Trajectory) -> int | None:
        room = self._c.generator.room(traj)
        return None if room == float("inf") else int(room)

    def encode(self, text: str) -> list[int]:
        if self._c.encode is None:
            raise RuntimeError("this episode adds text to answers: the controller needs encode=")
        return list(self._c.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._c.decode(list(ids))
