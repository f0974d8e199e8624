"""Episodes: what one rollout of a prompt group is. The controller hands a group of fresh
trajectories and an ``EpisodeContext`` to the configured episode, which generates (one turn or
several), asks for grades, and returns each trajectory's final verdict.

* ``single_turn`` (default): one answer per trajectory, graded once.
* ``retry``: a wrong answer gets the grader's feedback as the next message, up to ``max_turns``.
* ``import``: ``path: "package.module:factory"``: your own episode, no change to areal-flow.

Text the episode adds to an answer (feedback, tool output) is marked ``output_mask`` 0: context for
the policy, never trained.
"""

from areal_core.episodes.base import Episode, EpisodeContext, SingleTurn, append_environment
from areal_core.episodes.config import EpisodeConfig, make_episode
from areal_core.episodes.retry import RetryWithFeedback

__all__ = [
    "Episode",
    "EpisodeConfig",
    "EpisodeContext",
    "RetryWithFeedback",
    "SingleTurn",
    "append_environment",
    "make_episode",
]
