from __future__ import annotations

from dataclasses import asdict, dataclass

MAX_REASON = 1000  # characters of a reason kept (a program's exception message can be any length)


def valid_text(text: str) -> str:
    """``text`` as valid UTF-8 (a lone surrogate, which JSON can carry from a program's output, becomes "?"):
    what every writer of the run's records (parquet, JSON) accepts."""
    return text.encode("utf-8", "replace").decode("utf-8")


@dataclass
class RewardResult:
    """A grading verdict, with what was parsed and why, for debugging. Its text is always valid UTF-8 and
    the reason at most :data:`MAX_REASON` characters, whatever a program put into them."""

    correct: bool
    parsed: str | None = None  # the answer extracted from the response
    reason: str = ""  # e.g. "ok", "wrong answer", "no answer found", "timeout"
    score: float | None = None  # partial credit in 0..1 (reward.code_reward: fraction); None: all or nothing
    graded_by: str = ""  # the Dask worker that graded it (its address; "" when graded outside Dask)

    def __post_init__(self) -> None:
        self.correct = bool(self.correct)
        self.reason = valid_text(str(self.reason)[:MAX_REASON])
        if self.parsed is not None:
            self.parsed = valid_text(str(self.parsed))

    def as_dict(self) -> dict:
        return asdict(self)
