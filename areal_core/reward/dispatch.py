"""One entry point for grading, by task kind; runs inside Dask workers."""

from __future__ import annotations

from areal_core.reward.result import RewardResult

TASKS = ("chain",)


def grade(task: str, response: str, reference: str, tests: list[dict] | None = None) -> RewardResult:
    """Grade one response. ``task`` is a record's task kind."""
    if task == "chain":  # the reference is the full correct chain
        from areal_core.data.synthetic import grade_chain

        ok, parsed, reason = grade_chain(response, reference)
        return RewardResult(correct=ok, parsed=parsed, reason=reason)
    raise ValueError(f"no grader for task kind {task!r}; known: {', '.join(TASKS)}")
