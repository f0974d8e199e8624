"""pass@k and maj@k against independent references (brute-force enumeration, a product formula)."""

import itertools
import random

import pytest

from areal_core.eval import pass_at_k
from areal_core.eval.passk import maj_at_k


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of all k-subsets of the samples that contain a correct one."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def product_formula(n: int, c: int, k: int) -> float:
    """The numerically stable form used by the HumanEval paper's code, written out."""
    if n - c < k:
        return 1.0
    p = 1.0
    for i in range(n - c + 1, n + 1):
        p *= 1.0 - k / i
    return 1.0 - p


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_subsets(n):
    rng = random.Random(n)
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        rng.shuffle(outcomes)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_k_large_n_matches_product_formula():
    for n, c, k in [(200, 13, 1), (200, 13, 10), (200, 13, 100), (1000, 1, 500), (64, 0, 8), (64, 64, 8)]:
        assert pass_at_k(n, c, k) == pytest.approx(product_formula(n, c, k), rel=1e-9, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 1, 5) == 1.0


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_maj_at_k_votes_on_parsed_answers():
    answers = ["3", "4", "4", None, "3", "3"]
    correct = [True, False, False, False, True, True]
    assert maj_at_k(answers, correct, 3) is False  # "4" wins 2-1
    assert maj_at_k(answers, correct, 6) is True  # "3" wins 3-2
    assert maj_at_k(["1", "2"], [False, True], 2) is False  # tie: the first answer seen wins
    assert maj_at_k([None, None], [False, False], 2) is False
    assert maj_at_k(["x + 1", "x+1", "2"], [True, True, False], 3) is True  # whitespace does not split votes
