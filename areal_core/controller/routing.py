"""Multi-agent routing, the frozen policy's side (``areal_core/controller/agents.py`` picks each group's route):
frozen groups are not gated, not buffered and never trained; at most as many are in flight as the
gate lets trainable ones be; their verdicts are recorded for their agent."""

from __future__ import annotations

import asyncio

from areal_core.controller.agents import FROZEN, AgentRouter
from areal_core.controller.settings import ControllerSettings
from areal_core.types import Trajectory


class FrozenGroups:
    def __init__(self, settings: ControllerSettings, router: AgentRouter):
        self.router = router
        self.limit = max(1, (settings.eta + 1) * settings.batch_size // settings.n_samples)
        self.in_flight = 0  # groups
        self.generated = 0  # answers rewarded (recorded, never trained)
        self.tokens = 0  # their policy tokens (the controller's generated_tokens counts them too)
        self._slots: asyncio.Semaphore | None = None

    async def acquire(self) -> None:
        """A slot for one more frozen group (on the controller's loop)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        await self._slots.acquire()

    def release(self) -> None:
        self._slots.release()

    def started(self) -> None:
        self.in_flight += 1

    def done(self) -> None:
        self.in_flight -= 1
        self.release()

    def record(self, traj: Trajectory) -> None:
        """A frozen answer's verdict (the caller holds the controller's lock)."""
        self.generated += 1
        self.tokens += len(traj.policy_token_versions())
        self.router.record(traj.agent_id, traj.reward, traj.correct, FROZEN)

    def metrics(self) -> dict:
        return {
            "frozen_answers": self.generated,
            "frozen_tokens": self.tokens,
            "frozen_in_flight_groups": self.in_flight,
        }
