from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RewardResult:
    """A grading verdict, with what was parsed and why, for debugging."""

    correct: bool
    parsed: str | None = None  # the answer extracted from the response
    reason: str = ""  # e.g. "ok", "wrong answer", "no answer found", "timeout"
    score: float | None = None  # partial credit in 0..1 (reward.code_reward: fraction); None: all or nothing
    graded_by: str = ""  # the Dask worker that graded it (its address; "" when graded outside Dask)

    def as_dict(self) -> dict:
        return asdict(self)
