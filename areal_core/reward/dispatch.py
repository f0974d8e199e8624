"""One entry point for grading, by task kind; runs inside Dask workers."""

from __future__ import annotations

import queue
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
    wrong with reason :data:`TIMED_OUT` (see :func:`grade_batch`)."""
    return grade_batch([(task, response, reference, tests)], timeout_s)[0]


def grade_batch(items: list[tuple[str, str, str, list[dict] | None]], timeout_s: float) -> list[RewardResult]:
    """Grade ``(task, response, reference, tests)`` items in order (one Dask task for a group),
    each within ``timeout_s`` seconds of its start.

    The items are graded one after another in one daemon thread (starting a thread per
    answer cost more than grading a short one). An item still being graded after
    ``timeout_s`` is graded wrong with reason :data:`TIMED_OUT`; its thread, which Python
    cannot stop, is told to stop after it and left behind, and a fresh thread takes the
    items after it. A grader's exception is raised here.
    """
    results: list[RewardResult] = []
    while len(results) < len(items):
        first = len(results)
        done: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def work(first: int = first, done: queue.SimpleQueue = done, stop: threading.Event = stop) -> None:
            for item in items[first:]:
                if stop.is_set():
                    return
                try:
                    done.put(grade(*item))
                except Exception as e:  # raised again below, in the caller's thread
                    done.put(e)
                    return

        threading.Thread(target=work, name=f"grading-{items[first][0]}", daemon=True).start()
        while len(results) < len(items):
            try:
                out = done.get(timeout=timeout_s)
            except queue.Empty:
                stop.set()
                results.append(RewardResult(correct=False, reason=TIMED_OUT))
                break
            if isinstance(out, Exception):
                raise out
            results.append(out)
    return results
