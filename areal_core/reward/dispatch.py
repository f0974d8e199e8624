"""One entry point for grading, by task kind; runs inside Dask workers.

One answer, one verdict: :func:`grade_batch` grades each answer on its own, and whatever goes wrong while
an answer is graded (the grader raises on what the program produced, the sandbox fails, the grading runs
past its time) is that answer's verdict, wrong, with the reason. It raises only for what no answer causes
and every answer would meet: a malformed item (:class:`GradingInputError`) or a sandbox the config refuses
(``sandbox.WeakSandboxError``).
"""

from __future__ import annotations

import logging
import queue
import threading

from areal_core.reward.result import RewardResult

log = logging.getLogger(__name__)
TASKS = ("chain", "math", "code")
TIMED_OUT = "grading timed out"  # the reason of an answer whose grading ran past reward.timeout_s
GRADING_FAILED = "grading failed"  # the reason's start for an answer whose grading raised
CODE_REWARDS = ("all_pass", "fraction")  # reward.code_reward: see grade_partial


class GradingInputError(ValueError):
    """An item that cannot be graded whatever its answer says (an unknown task, a code item without valid
    tests, a math item without a reference): a caller's or a data set's error, raised, never a verdict."""


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
        program, result = _run_code(response, tests)
        return RewardResult(correct=result.passed, parsed=program[:2000], reason=result.reason)
    raise ValueError(f"no grader for task kind {task!r}; known: {', '.join(TASKS)}")


def _run_code(response: str, tests: list[dict] | None):
    """``(program, CodeResult)``: the response's program run against ``tests`` in the sandbox."""
    from areal_core.reward.code import extract_code, grade_code

    if not tests:
        raise ValueError("a code task needs tests to grade against")
    program = extract_code(response)
    return program, grade_code(program, tests)


def _passed_share(program: str, tests: list[dict], first) -> float:
    """The share of ``tests`` that ``program`` passes, given ``first``, its graded run against all of them.

    A graded run stops at the first failing test, so the tests after it are graded again
    (from the one after the failure), until a run passes the rest or fails for no test in
    particular (it did not load, timed out, or broke off between tests): the tests it did not
    reach then count as failed. Each failing test costs one more sandbox run at most."""
    from areal_core.reward.code import grade_code

    passed, start, run = 0, 0, first
    while True:
        passed += run.n_passed
        if run.passed or not run.details or run.details[-1]["ok"]:
            break
        start += len(run.details)  # the tests up to and including the failing one
        if start >= len(tests):
            break
        run = grade_code(program, tests[start:])
    return passed / len(tests)


def grade_partial(task: str, response: str, reference: str, tests: list[dict] | None = None) -> RewardResult:
    """:func:`grade`, with partial credit for code (``reward.code_reward: fraction``): the result's
    ``score`` is the share of the tests the program passes (``correct`` still means all of them)."""
    if task != "code":
        return grade(task, response, reference, tests)
    program, result = _run_code(response, tests)
    return RewardResult(
        correct=result.passed, parsed=program[:2000], reason=result.reason, score=_passed_share(program, tests, result)
    )


def grade_batch(
    items: list[tuple[str, str, str, list[dict] | None]],
    timeout_s: float,
    code_reward: str = "all_pass",
    allow_weak_sandbox: bool | None = None,
) -> list[RewardResult]:
    """Grade ``(task, response, reference, tests)`` items in order (one Dask task for a group),
    each within ``timeout_s`` seconds of its start; ``code_reward: fraction`` grades with
    :func:`grade_partial` (a score for the share of tests passed), ``all_pass`` with :func:`grade`.

    ``allow_weak_sandbox`` (training: ``reward.allow_weak_sandbox``): where code is graded in a
    sandbox that lacks a guarantee (``sandbox.require_strong``), False raises
    ``sandbox.WeakSandboxError`` and True grades with a warning; None (evaluation, benchmarks)
    does not ask.

    The items are graded one after another in one daemon thread (starting a thread per
    answer cost more than grading a short one). An item still being graded after
    ``timeout_s`` is graded wrong with reason :data:`TIMED_OUT`; its thread, which Python
    cannot stop, is told to stop after it and left behind, and a fresh thread takes the
    items after it. A grader's exception while grading an item is that item's verdict (wrong,
    reason :data:`GRADING_FAILED` and the exception, logged); a malformed item raises
    :class:`GradingInputError` before anything is graded.
    """
    if code_reward not in CODE_REWARDS:
        raise ValueError(f"code_reward must be one of {CODE_REWARDS}, got {code_reward!r}")
    for k, item in enumerate(items):
        check_item(item, k)
    grader = grade if code_reward == "all_pass" else grade_partial
    if allow_weak_sandbox is not None and any(item[0] == "code" for item in items):
        from areal_core.reward.sandbox import require_strong

        require_strong(allow_weak_sandbox)
    batched = _grade_functional_together(items, code_reward)  # index -> result
    rest = [i for i in range(len(items)) if i not in batched]
    for i, r in zip(rest, _grade_in_order([items[i] for i in rest], timeout_s, grader)):
        batched[i] = r
    where = _worker_address()
    for r in batched.values():
        r.graded_by = where
    return [batched[i] for i in range(len(items))]


def _worker_address() -> str:
    """The address of the Dask worker running this (the ledger's ``graded_by``); "" outside one."""
    from distributed import get_worker

    try:
        return get_worker().address
    except ValueError:  # not in a worker's task
        return ""


def check_item(item: tuple, k: int = 0) -> None:
    """A ``(task, response, reference, tests)`` item that can be graded, else :class:`GradingInputError` naming
    item ``k`` and what is wrong."""
    task, _, reference, tests = item
    if task not in TASKS:
        raise GradingInputError(f"item {k}: no grader for task kind {task!r}; known: {', '.join(TASKS)}")
    if task == "math" and not str(reference).strip():
        raise GradingInputError(f"item {k}: empty math reference answer")
    if task == "code":
        if not tests:
            raise GradingInputError(f"item {k}: a code task needs tests to grade against")
        from areal_core.reward.code import check_tests

        try:
            check_tests(tests)
        except ValueError as e:
            raise GradingInputError(f"item {k}: {e}") from None


def failed_verdict(error: BaseException) -> RewardResult:
    """The verdict of an answer whose grading failed with ``error``: wrong; the reason names the error (its type
    and the first line of its message)."""
    first = (str(error).splitlines() or [""])[0][:200]
    return RewardResult(correct=False, reason=f"{GRADING_FAILED}: {type(error).__name__}: {first}")


def failed(item: tuple, error: BaseException) -> RewardResult:
    """:func:`failed_verdict` for an item whose grader raised here (logged with its trace)."""
    log.error("grading a %s answer raised %r: graded wrong", item[0], error, exc_info=error)
    return failed_verdict(error)


def _grade_functional_together(items: list[tuple], code_reward: str) -> dict[int, RewardResult]:
    """The code answers with functional tests among ``items``, graded in batched sandbox runs
    (``code.grade_functional_many``: the verdicts grading them one by one gives, at a fraction of
    the start-up cost); by index. Each program is bounded by the sandbox's wall time, not
    ``timeout_s``. Partial credit's extra runs (after a failing test) go one by one. If the
    batched grading raises, its items are left to be graded one by one (each its own verdict)."""
    picked = [
        i
        for i, (task, _, _, tests) in enumerate(items)
        if task == "code" and tests and tests[0].get("testtype") == "functional"
    ]
    if len(picked) < 2:
        return {}
    from areal_core.reward.code import extract_code, grade_functional_many

    programs = [extract_code(items[i][1]) for i in picked]
    try:
        verdicts = grade_functional_many(programs, [items[i][3] for i in picked])
    except Exception as e:  # logged; each of these answers is then graded alone
        log.error("batched grading of %d answers raised %r; grading them one by one", len(picked), e, exc_info=e)
        return {}
    out = {}
    for i, program, v in zip(picked, programs, verdicts):
        try:
            score = _passed_share(program, items[i][3], v) if code_reward == "fraction" else None
        except Exception as e:  # noqa: BLE001 - this answer's verdict (wrong, reason and trace logged)
            out[i] = failed(items[i], e)
            continue
        out[i] = RewardResult(correct=v.passed, parsed=program[:2000], reason=v.reason, score=score)
    return out


def _grade_in_order(items: list[tuple], timeout_s: float, grader) -> list[RewardResult]:
    """Each item's result in order, by ``grader``, in one thread at a time (see :func:`grade_batch`)."""
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
                    done.put(grader(*item))
                except Exception as e:  # noqa: BLE001 - this answer's verdict: wrong, reason and trace logged
                    done.put(failed(item, e))

        threading.Thread(target=work, name=f"grading-{items[first][0]}", daemon=True).start()
        while len(results) < len(items):
            try:
                out = done.get(timeout=timeout_s)
            except queue.Empty:
                stop.set()
                results.append(RewardResult(correct=False, reason=TIMED_OUT))
                break
            results.append(out)
    return results
