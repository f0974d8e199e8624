"""A rollout controller built from a run's settings: its admission, generator, server recovery,
grader and (multi-agent runs) frozen groups, each made here and handed to it."""

from __future__ import annotations

from collections.abc import Callable

from areal_core.controller.admission import Admission
from areal_core.controller.buffer import ReplayBuffer
from areal_core.controller.core import RolloutController
from areal_core.controller.generation import Generator
from areal_core.controller.grading import Grader
from areal_core.controller.recovery import ServerRecovery
from areal_core.controller.routing import FrozenGroups
from areal_core.controller.settings import AgentSetup, ControllerSettings, Servers
from areal_core.episodes import Episode
from areal_core.reward.service import RewardService
from areal_core.rollout.weight_transport import WeightTransport
from areal_core.types import Prompt


def make_controller(
    servers: Servers,
    prompts: list[Prompt],
    decode: Callable,
    rewards: RewardService,
    buffer: ReplayBuffer,
    settings: ControllerSettings,
    transport: WeightTransport,
    *,
    version: int = 0,
    episode: Episode | None = None,
    encode: Callable | None = None,
    agents: AgentSetup | None = None,
) -> RolloutController:
    """``servers``: the trainable policy's; ``transport`` moves new weights to them; ``decode`` /
    ``encode``: token ids <-> response text (``encode`` only for episodes that add text to an answer);
    ``agents``: a multi-agent run's routing; ``version``: the weights the servers hold."""
    if not prompts:
        raise ValueError("the controller needs at least one prompt")
    if agents is not None and agents.router.top_k < len(agents.router.ids) and agents.frozen is None:
        raise ValueError("agents routed to the frozen policy need frozen servers")
    frozen = agents.frozen if agents is not None else None
    # weight pushes and server recovery; a restarted server loads model_path (version), then the weights
    recovery = ServerRecovery(
        transport,
        servers.request_timeout_s,
        servers.restart,
        servers.model_path,
        version,
        frozen.restart if frozen else None,
        frozen.model_path if frozen else "",
        agents.frozen_version if agents else 0,
        elastic=settings.min_servers is not None,
    )
    admission = Admission(prompts, settings, version)
    return RolloutController(
        servers,
        decode,
        buffer,
        settings,
        admission,
        Generator(settings, recovery, lambda: admission.version),
        recovery,
        Grader(rewards, prompts, settings),
        episode=episode,
        encode=encode,
        agents=agents,
        frozen=FrozenGroups(settings, agents.router) if agents is not None else None,
    )
