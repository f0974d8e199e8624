"""The math grader: answer extraction and math-verify equivalence, in the main thread and in threads."""

import threading
import time

import pytest

from areal_core.reward import grade_math, grade_math_result
from areal_core.reward.dispatch import grade
from areal_core.reward.math import extract_final_answer, last_boxed

EQUIVALENT = [
    ("The result is $\\boxed{0.5}$.", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("So we get \\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{1000}", "1,000"),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("... and so the answer is 204.", 204),  # AIME: integer reference
    ("\\boxed{070}", "70"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{104.}", "104"),  # a sentence's full stop inside the box
    ("$\\boxed{\\textbf{(073)}}$", 73),  # AoPS-style bold answer, integer reference
]
NOT_EQUIVALENT = [
    ("\\boxed{0.49}", "\\frac{1}{2}"),
    ("\\boxed{x^2+2x}", "(x+1)^2"),
    ("#### 71", "72"),
    ("The answer is 205", 204),
    ("\\boxed{3} ... wait, actually \\boxed{4}", "3"),  # the LAST boxed answer counts
]


@pytest.mark.parametrize("response,reference", EQUIVALENT)
def test_equivalent_answers_are_correct(response, reference):
    assert grade_math(response, reference) is True


@pytest.mark.parametrize("response,reference", NOT_EQUIVALENT)
def test_different_answers_are_wrong(response, reference):
    assert grade_math(response, reference) is False


def test_extraction():
    assert last_boxed("a \\boxed{\\frac{a}{b}} b \\boxed{\\sqrt{\\frac{1}{2}}} c") == "\\sqrt{\\frac{1}{2}}"
    assert last_boxed("\\boxed{unclosed") is None
    assert extract_final_answer("#### 1,234") == "1,234"
    assert extract_final_answer("So the final answer is $42$.") == "42"
    assert extract_final_answer("The answer is 3.5.") == "3.5"
    assert extract_final_answer("I am not sure.") is None


def test_result_keeps_parsed_answer_and_reason():
    r = grade_math_result("so \\boxed{7}", "8")
    assert (r.correct, r.parsed, r.reason) == (False, "7", "wrong answer")
    r = grade_math_result("no idea", "8")
    assert (r.correct, r.parsed, r.reason) == (False, None, "no answer found")
    with pytest.raises(ValueError):
        grade_math_result("\\boxed{1}", "  ")


def test_dispatch_routes_math():
    r = grade("math", "\\boxed{\\frac{2}{4}}", "0.5")
    assert r.correct and r.parsed == "\\frac{2}{4}"


def test_grading_from_threads_matches_main_thread():
    """Dask runs tasks in threads, where math-verify's signal timeouts cannot work: the helper processes do."""
    cases = EQUIVALENT + NOT_EQUIVALENT
    expected = [grade_math(r, ref) for r, ref in cases]
    got: dict[int, bool] = {}

    def work(offset: int) -> None:
        for i in range(offset, len(cases), 2):
            got[i] = grade_math(*cases[i])

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(cases))] == expected


def test_hung_helper_is_killed_at_the_hard_limit(monkeypatch):
    """A comparison that never returns is cut off at the hard limit; the next call gets a fresh helper."""
    from areal_core.reward import math as mathmod

    pool = mathmod._HelperPool(1)
    helper = mathmod._Helper()
    helper.proc.stdin.write(b"")  # a helper that is busy forever: stop it from reading
    helper.proc.send_signal(19)  # SIGSTOP
    pool._idle.put(helper)
    t0 = time.monotonic()
    ok, reason = pool.verify("1", "2", limit_s=1.0)
    assert (ok, reason) == (False, "timeout (helper process killed)")
    assert time.monotonic() - t0 < 5
    assert helper.proc.poll() is not None  # killed
    assert pool.verify("\\frac{1}{2}", "0.5", limit_s=60) == (True, "ok")  # a fresh helper answers


def test_warm_leaves_a_started_helper_that_grading_then_uses():
    from areal_core.reward import math as mathmod

    pool = mathmod._HelperPool(1)
    pool.warm()
    helper = pool._idle.get_nowait()
    assert helper.proc.poll() is None  # started, alive, math-verify imported (it answered)
    pool._idle.put(helper)
    assert pool.verify("\\frac{1}{2}", "0.5") == (True, "ok")
    assert pool._idle.get_nowait() is helper  # the warmed helper answered: no second start
    helper.kill()


def test_reward_workers_start_their_helper_when_the_data_holds_math():
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    def _idle_helpers() -> int:  # runs in the worker (a nested function travels by value)
        from areal_core.reward import math as mathmod

        return 0 if mathmod._pool is None else mathmod._pool._idle.qsize()

    with RewardService(RewardConfig(n_workers=1)) as rewards:
        rewards.warm_up({"chain", "code"})
        time.sleep(1.0)
        assert list(rewards.client.run(_idle_helpers).values()) == [0]  # no math: nothing started
        rewards.warm_up({"chain", "math"})
        deadline = time.monotonic() + 60
        while list(rewards.client.run(_idle_helpers).values()) != [1]:
            assert time.monotonic() < deadline, "the worker's math helper never started"
            time.sleep(0.2)
