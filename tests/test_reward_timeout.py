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
        rewards.submit_batch([("chain", CORRECT, CORRECT, None), ("chain", "slow", CORRECT, None),
                              ("chain", CORRECT, CORRECT, None)],
                             on_done=lambda r, e: (got.append((r, e)), done.set()))
        assert done.wait(10), "the group waited for the slow grading"
        assert time.monotonic() - t0 < 5
        (results, error), = got
        assert error is None
        assert [(r.correct, r.reason == TIMED_OUT) for r in results] == [(True, False), (False, True), (True, False)]
        assert rewards.n_timed_out == 1
        # the held-out evaluation's path too; the worker is free although the first slow grading still sleeps
        results = rewards.grade_many("chain", ["slow", CORRECT], [CORRECT, CORRECT])
        assert [(r.correct, r.reason) for r in results] == [(False, TIMED_OUT), (True, "ok")]
        assert rewards.n_timed_out == 2
