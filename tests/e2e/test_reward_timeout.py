"""reward.timeout_s: an answer whose grading runs longer is graded wrong ("grading timed out") and
counted, instead of being waited for; the other answers of its group are graded as usual."""

from __future__ import annotations

import threading
import time

from areal_core.reward.config import RewardConfig
from areal_core.reward.service import RewardService

CORRECT = "a1b2|2"
TIMED_OUT = "grading timed out"  # the documented reason


def test_grading_past_the_timeout_is_graded_wrong_and_counted():
    def slow_grader(delay: float) -> None:
        """Runs in the Dask worker: its grader takes ``delay`` seconds for the response "slow" and
        grades anything else correct at once."""
        from areal_core.reward import dispatch
        from areal_core.reward.result import RewardResult

        def sleepy(task, response, reference, tests=None):
            if response == "slow":
                time.sleep(delay)
            return RewardResult(correct=True, reason="ok")

        dispatch.grade = sleepy

    with RewardService(RewardConfig(n_workers=1, timeout_s=1.0)) as rewards:
        rewards.client.run(slow_grader, 60.0)
        got, done = [], threading.Event()
        t0 = time.monotonic()
        rewards.submit_batch(
            [("chain", CORRECT, CORRECT, None), ("chain", "slow", CORRECT, None), ("chain", CORRECT, CORRECT, None)],
            on_done=lambda r, e: (got.append((r, e)), done.set()),
        )
        assert done.wait(10), "the group waited for the slow grading"
        assert time.monotonic() - t0 < 5
        ((results, error),) = got
        assert error is None
        assert [(r.correct, r.reason == TIMED_OUT) for r in results] == [(True, False), (False, True), (True, False)]
        assert rewards.n_timed_out == 1
        # the held-out evaluation's path too; the worker is free although the first slow grading still sleeps
        results = rewards.grade_many("chain", ["slow", CORRECT], [CORRECT, CORRECT])
        assert [(r.correct, r.reason) for r in results] == [(False, TIMED_OUT), (True, "ok")]
        assert rewards.n_timed_out == 2


def test_grade_batch_uses_one_thread_and_replaces_it_only_after_a_timeout(monkeypatch):
    """In-process: a batch is graded in one thread; a hung item is graded TIMED_OUT after timeout_s,
    its thread grades nothing more, and a fresh thread grades the items after it."""
    from areal_core.reward import dispatch
    from areal_core.reward.result import RewardResult

    graded, release = [], threading.Event()

    def fake(task, response, reference, tests=None):
        if response == "hang":
            release.wait(30)
        graded.append((response, threading.current_thread().ident))
        return RewardResult(correct=response == reference, reason="ok")

    monkeypatch.setattr(dispatch, "grade", fake)
    items = [("chain", r, "x", None) for r in ("x", "y", "x")]
    out = dispatch.grade_batch(items, timeout_s=5.0)
    assert [r.correct for r in out] == [True, False, True]
    assert len({tid for _, tid in graded}) == 1  # one thread for the whole batch

    graded.clear()
    t0 = time.monotonic()
    out = dispatch.grade_batch([("chain", r, "x", None) for r in ("x", "hang", "x", "y")], timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert [(r.correct, r.reason) for r in out] == [(True, "ok"), (False, TIMED_OUT), (True, "ok"), (False, "ok")]
    release.set()  # the hung grading ends: its thread must not grade the items after it again
    time.sleep(0.2)
    assert [resp for resp, _ in graded] == ["x", "x", "y", "hang"]
    assert graded[0][1] != graded[1][1]  # the items after the hung one ran in a fresh thread


def test_a_graders_error_is_that_answers_verdict(monkeypatch):
    """One answer, one verdict: a grader raising on one answer grades that answer wrong (the reason names the
    error) and the others as usual; a malformed item raises before anything is graded."""
    import pytest

    from areal_core.reward import dispatch

    real = dispatch.grade

    def broken(task, response, reference, tests=None):
        if response == "boom":
            raise OverflowError("int too large to convert to float")
        return real(task, response, reference, tests)

    monkeypatch.setattr(dispatch, "grade", broken)
    items = [("chain", CORRECT, CORRECT, None), ("chain", "boom", CORRECT, None), ("chain", CORRECT, CORRECT, None)]
    for _ in range(2):  # the answer after the failing one is graded in the same thread, as before
        out = dispatch.grade_batch(items, timeout_s=5.0)
        assert [r.correct for r in out] == [True, False, True]
        assert out[1].reason == "grading failed: OverflowError: int too large to convert to float"
        items = items[::-1]
    with pytest.raises(dispatch.GradingInputError, match=r"item 1: no grader for task kind 'poem'"):
        dispatch.grade_batch([("chain", CORRECT, CORRECT, None), ("poem", "x", "y", None)], timeout_s=5.0)
    with pytest.raises(dispatch.GradingInputError, match=r"item 0: a code task needs tests"):
        dispatch.grade_batch([("code", "print(1)", "", None)], timeout_s=5.0)
