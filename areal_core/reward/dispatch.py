"""One entry point for grading, by task kind; runs inside Dask workers."""

from __future__ import annotations

import threading

from areal_core.reward.result import RewardResult

TASKS = ("chain", "math", "code")
TIMED_OUT = "grading timed out"  # the reason of an answer whose grading ran past reward.timeout_s


def grade(task: str, response: str, reference: str, tests: list[dict] | None = None) -> RewardResult:
    """Grade one response. ``task`` is a record's task kind.

    chain: ``reference`` is the full correct chain. math: ``reference`` is the
    reference answer. code: ``tests`` are the record's tests (``reference`` is
    not used); the program is the response's last fenced code block.
    """
    if task == "chain":
        from areal_core.data.synthetic import grade_chain

        ok, parsed, reason = grade_chain(response, reference)
        return RewardResult(correct=ok, parsed=parsed, reason=reason)
    if task == "math":
        from areal_core.reward.math import grade_math_result

        return grade_math_result(response, reference)
    if task == "code":
        from areal_core.reward.code import extract_code, grade_code

        if not tests:
            raise ValueError("a code task needs tests to grade against")
        program = extract_code(response)
        result = grade_code(program, tests)
        return RewardResult(correct=result.passed, parsed=program[:2000], reason=result.reason)
    raise ValueError(f"no grader for task kind {task!r}; known: {', '.join(TASKS)}")


def grade_within(timeout_s: float, task: str, response: str, reference: str,
                 tests: list[dict] | None = None) -> RewardResult:
    """:func:`grade`, given ``timeout_s`` seconds: an answer still being graded then is graded
    wrong with reason :data:`TIMED_OUT`. The grading runs in a daemon thread of its own, which
    Python cannot stop: it is left to finish (or hang) in the background."""
    outcome: list = []

    def work() -> None:
        try:
            outcome.append(grade(task, response, reference, tests))
        except Exception as e:  # raised again below, in the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=work, name=f"grading-{task}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return RewardResult(correct=False, reason=TIMED_OUT)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def grade_batch(items: list[tuple[str, str, str, list[dict] | None]], timeout_s: float) -> list[RewardResult]:
    """Grade ``(task, response, reference, tests)`` items in order (one Dask task for a group),
    each within ``timeout_s`` (:func:`grade_within`)."""
    return [grade_within(timeout_s, *item) for item in items]
