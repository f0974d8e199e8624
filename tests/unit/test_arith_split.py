"""The arithmetic task's held-out split (areal_core/data/synthetic_arith.py): no held-out calculation is
trained on in any wording or order."""

import pytest

from areal_core.data.config import SyntheticArithTask
from areal_core.data.synthetic_arith import ArithTask, calculation, is_eval_problem


def _calc(record) -> tuple:
    m = record.meta
    return calculation(m["op"], m["a"], m["b"], int(record.answer))


@pytest.fixture(scope="module")
def task():
    return ArithTask(SyntheticArithTask(kind="arith", n_train=4000, n_eval=400, seed=0))


def test_no_held_out_calculation_is_trained_on_in_either_order_or_wording(task):
    train = {_calc(r) for r in task.train_records()}
    held = {_calc(r) for r in task.eval_records()}
    assert train and held and not train & held

    # checked on the raw records too: no held-out sum or product appears in training in either order
    def pairs(records, op):
        return {(r.meta["a"], r.meta["b"]) for r in records if r.meta["op"] == op}

    for op in ("add", "mul"):
        held_pairs = pairs(task.eval_records(), op)
        trained_pairs = pairs(task.train_records(), op)
        assert held_pairs and not trained_pairs & (held_pairs | {(b, a) for a, b in held_pairs})


def test_a_calculation_is_one_whatever_its_form():
    assert calculation("add", 47, 38, 85) == calculation("add", 38, 47, 85) == calculation("word", 38, 47, 85)
    assert calculation("mul", 7, 16, 112) == calculation("mul", 16, 7, 112)
    assert calculation("sub", 83, 29, 54) == calculation("word", 83, 29, 54) != calculation("word", 83, 29, 112)
    for calc in [("+", 38, 47), ("*", 7, 16), ("-", 83, 29)]:
        assert is_eval_problem(calc, 0) == is_eval_problem(calc, 0)  # a function of the calculation alone


def test_the_share_held_out_is_about_a_fifth_of_calculations():
    calcs = [("+", a, b) for a in range(10, 100) for b in range(a, 100)]
    share = sum(is_eval_problem(c, 0) for c in calcs) / len(calcs)
    assert 0.17 < share < 0.23
