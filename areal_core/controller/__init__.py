"""The rollout controller (``core.py``) and its parts: admission (``admission.py``), generation
(``generation.py``), server recovery (``recovery.py``), multi-agent routing (``routing.py``)."""

from areal_core.controller.core import RolloutController
from areal_core.controller.generation import MAX_RESUBMITS
from areal_core.controller.settings import AgentSetup, ControllerSettings, Servers, group_id, prompt_of

__all__ = ["MAX_RESUBMITS", "AgentSetup", "ControllerSettings", "RolloutController", "Servers", "group_id", "prompt_of"]
