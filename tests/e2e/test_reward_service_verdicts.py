"""The reward service gives each answer a verdict: a grading task that fails as a whole (its result cannot be
sent back, its worker keeps dying) is split, and only the answer that breaks it is graded wrong; errors that no
answer causes (a refused sandbox, a malformed item, the client shutting down) still reach the caller."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError
from types import SimpleNamespace

import pytest

from areal_core.reward import service as service_mod
from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import GradingInputError
from areal_core.reward.result import RewardResult
from areal_core.reward.sandbox import WeakSandboxError
from areal_core.reward.service import RewardService
from tests.done_future import DoneFuture

RIGHT = "a1b2|2"
BREAKS_ITS_TASK = "a1b2|9"  # the answer whose grading's result cannot leave the worker (below)
ITEMS = [("chain", r, RIGHT, None) for r in (RIGHT, BREAKS_ITS_TASK, RIGHT)]


def _service(outcome_of) -> RewardService:
    """A service whose client answers each grading task with ``outcome_of(items)`` (no cluster)."""
    svc = RewardService.__new__(RewardService)
    svc.cfg = RewardConfig()
    svc.n_resubmitted = svc.n_timed_out = svc.n_failed = svc.n_tasks = 0
    svc._pending, svc._in_flight, svc._max_in_flight, svc._coalesce_lock = [], 0, 1, threading.Lock()
    svc.client = SimpleNamespace(submit=lambda fn, items, *a, **k: DoneFuture(outcome_of(items)))
    return svc


def _killed():
    from distributed.scheduler import KilledWorker

    return KilledWorker("k", SimpleNamespace(address="tcp://w"), 0)


def test_a_batch_whose_workers_keep_dying_is_split_and_only_the_killer_is_graded_wrong():
    tasks = []

    def outcome(items):
        tasks.append(len(items))
        if len(items) > 1 or items[0][1] == BREAKS_ITS_TASK:
            return _killed()
        return [RewardResult(correct=True, reason="ok")]

    svc = _service(outcome)
    got = []
    svc.submit_batch(ITEMS, on_done=lambda results, error: got.append((results, error)))
    ((results, error),) = got
    assert error is None and [r.correct for r in results] == [True, False, True]
    assert results[1].reason.startswith("grading failed: KilledWorker")
    # the batch: 1 + RESUBMITS tries; then each answer alone (the killer: 1 + RESUBMITS tries too)
    assert tasks == [3] * (1 + service_mod.RESUBMITS) + [1] + [1] * (1 + service_mod.RESUBMITS) + [1]
    assert svc.n_failed == 1 and svc.n_resubmitted == 2 * service_mod.RESUBMITS


@pytest.mark.parametrize(
    "error", [WeakSandboxError("weak"), GradingInputError("item 0: no tests"), CancelledError()], ids=type
)
def test_what_no_answer_causes_reaches_the_caller(error):
    svc = _service(lambda items: error)
    got = []
    svc.submit_batch(ITEMS, on_done=lambda results, e: got.append((results, e)))
    assert got == [(None, error)]


@pytest.mark.slow
def test_an_answer_whose_result_cannot_leave_the_worker_is_graded_wrong_alone():
    """Real Dask: one answer's result holds a lock (it cannot be pickled back): the batch's task fails as a whole,
    its answers are graded again one task each, and only that answer is graded wrong; grade_many likewise."""

    def unsendable_result_for_one_answer():  # in the worker (a nested function travels by value)
        import threading

        from areal_core.reward import dispatch

        real = dispatch.grade

        def grade(task, response, reference, tests=None):
            r = real(task, response, reference, tests)
            if response == "a1b2|9":
                r.lock = threading.Lock()
            return r

        dispatch.grade = grade

    with RewardService(RewardConfig(n_workers=1)) as rewards:
        rewards.client.run(unsendable_result_for_one_answer)
        got, done = [], threading.Event()
        rewards.submit_batch(ITEMS, on_done=lambda results, error: (got.append((results, error)), done.set()))
        assert done.wait(60)
        ((results, error),) = got
        assert error is None and [r.correct for r in results] == [True, False, True]
        assert results[1].reason == "grading failed: TypeError: Could not serialize object of type RewardResult"
        many = rewards.grade_many("chain", [RIGHT, BREAKS_ITS_TASK], [RIGHT, RIGHT])
        assert [r.correct for r in many] == [True, False] and many[1].reason == results[1].reason
        assert rewards.n_failed == 2
