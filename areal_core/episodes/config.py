"""``episode:`` in an experiment config: which episode rolls out a prompt group (a tagged union)."""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from areal_core.configbase import Section


class SingleTurnConfig(Section):
    kind: Literal["single_turn"] = "single_turn"


class RetryConfig(Section):
    """A wrong answer gets ``feedback`` (``{reason}``: the grader's, ``{parsed}``: the answer it read)
    and another turn, up to ``max_turns`` answers; a right answer at turn k earns
    ``discount**(k-1)`` of the way from reward_wrong to reward_correct."""
    kind: Literal["retry"] = "retry"
    max_turns: int = Field(2, ge=1)
    discount: float = Field(1.0, gt=0.0, le=1.0)
    feedback: str = "\nwrong ({reason}); again: "
    max_new_tokens_per_turn: int | None = Field(None, ge=1)  # None: rollout.sampling.max_new_tokens


class ImportedConfig(Section):
    """``path: "package.module:factory"``: ``factory(**options)`` returns an episode."""
    kind: Literal["import"] = "import"
    path: str = Field(pattern=r"^[\w.]+:\w+$")
    options: dict[str, Any] = {}


EpisodeConfig = Annotated[Union[SingleTurnConfig, RetryConfig, ImportedConfig], Field(discriminator="kind")]


def make_episode(cfg):
    from areal_core.episodes.base import SingleTurn
    from areal_core.episodes.retry import RetryWithFeedback

    if cfg.kind == "single_turn":
        return SingleTurn()
    if cfg.kind == "retry":
        return RetryWithFeedback(cfg.max_turns, cfg.discount, cfg.feedback, cfg.max_new_tokens_per_turn)
    module, name = cfg.path.split(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"episode.path {cfg.path!r}: {e}") from None
    return factory(**cfg.options)
