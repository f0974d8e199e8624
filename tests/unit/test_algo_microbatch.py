"""Dynamic micro-batching (first-fit decreasing) and the fixed contiguous split."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.algo import allocate_microbatches, split_fixed

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def packing_problem(draw):
    max_tokens = draw(st.integers(1, 64))
    seqlens = draw(st.lists(st.integers(0, max_tokens), max_size=40))
    return seqlens, max_tokens


def totals(groups, seqlens):
    return [sum(seqlens[i] for i in g) for g in groups]


@SETTINGS
@given(packing_problem())
def test_packing_properties(problem):
    seqlens, max_tokens = problem
    groups = allocate_microbatches(seqlens, max_tokens)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(seqlens)))  # every index exactly once
    assert all(g for g in groups)  # no empty micro-batch
    sizes = totals(groups, seqlens)
    assert all(t <= max_tokens for t in sizes)
    assert len(groups) >= math.ceil(sum(seqlens) / max_tokens)
    # first-fit: a later group's first item did not fit into any earlier group
    for h in range(len(groups)):
        for g in range(h):
            assert sizes[g] + sizes[h] > max_tokens
    assert allocate_microbatches(torch.tensor(seqlens, dtype=torch.long), max_tokens) == groups


@SETTINGS
@given(packing_problem(), st.data())
def test_too_long_sequence_is_reported(problem, data):
    seqlens, max_tokens = problem
    idx = data.draw(st.integers(0, len(seqlens)))
    too_long = data.draw(st.integers(max_tokens + 1, max_tokens + 100))
    seqlens = seqlens[:idx] + [too_long] + seqlens[idx:]
    with pytest.raises(ValueError) as info:
        allocate_microbatches(seqlens, max_tokens)
    msg = str(info.value)
    assert f"sequence {idx} " in msg and str(too_long) in msg and f"max_tokens={max_tokens}" in msg


@pytest.mark.parametrize(
    "seqlens,max_tokens,expected",
    [
        ([7, 6, 5, 4, 3, 2, 1], 10, [[0, 4], [1, 3], [2, 5, 6]]),
        ([3, 5, 4, 5, 3, 4], 8, [[1, 0], [3, 4], [2, 5]]),
        ([2, 2, 2, 2], 4, [[0, 1], [2, 3]]),  # ties keep input order
        ([1, 9, 1, 9], 10, [[1, 0], [3, 2]]),
        ([4, 0, 4], 4, [[0, 1], [2]]),
        ([], 5, []),
    ],
)
def test_known_optimal_packings(seqlens, max_tokens, expected):
    groups = allocate_microbatches(seqlens, max_tokens)
    assert groups == expected
    assert len(groups) == math.ceil(sum(seqlens) / max_tokens)  # optimal


def test_ffd_beats_fixed_split_on_skewed_lengths():
    seqlens = [90, 80, 10, 20, 70, 60, 30, 40]
    groups = allocate_microbatches(seqlens, 100)
    assert len(groups) == 4 and totals(groups, seqlens) == [100] * 4
    fixed = split_fixed(len(seqlens), 4)
    assert max(totals(fixed, seqlens)) > 100  # the naive split would overflow the budget


def test_input_errors():
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        allocate_microbatches([1], 0)
    with pytest.raises(ValueError, match=r"seqlens\[1\] is negative"):
        allocate_microbatches([1, -2], 5)
    with pytest.raises(TypeError, match="integers"):
        allocate_microbatches(torch.tensor([1.0, 2.0]), 5)
    with pytest.raises(ValueError, match="1-D"):
        allocate_microbatches(torch.ones(2, 2, dtype=torch.long), 5)
    with pytest.raises(TypeError, match=r"seqlens\[0\]"):
        allocate_microbatches([1.5], 5)


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 50))
def test_split_fixed_properties(n_items, n_groups):
    if n_items < n_groups:
        with pytest.raises(ValueError, match="non-empty"):
            split_fixed(n_items, n_groups)
        return
    groups = split_fixed(n_items, n_groups)
    assert len(groups) == n_groups
    assert [i for g in groups for i in g] == list(range(n_items))  # contiguous, in order
    sizes = [len(g) for g in groups]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_fixed_examples_and_errors():
    assert split_fixed(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_fixed(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="n_groups must be > 0"):
        split_fixed(3, 0)
    with pytest.raises(ValueError, match="n_items=2 into n_groups=3"):
        split_fixed(2, 3)


def test_shared_prompt_units_count_the_prompt_once():
    from areal_core.algo import allocate_shared_prompt_microbatches

    p, q = [1, 2, 3, 4], [5, 6]
    prompts = [p, q, p, p, q, [9]]
    answers = [3, 10, 2, 5, 1, 4]
    groups = allocate_shared_prompt_microbatches(prompts, answers, 16)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:  # within budget, counting each distinct prompt once
        cost = sum(len(pr) for pr in {tuple(prompts[i]) for i in g}) + sum(answers[i] for i in g)
        assert cost <= 16, (g, cost)
    # p's three answers (4 + 3 + 2 + 5 = 14 tokens) fit together: one unit, not 3 sequences of 7, 6, 9
    assert any(set(g) >= {0, 2, 3} for g in groups)


def test_shared_prompt_unit_over_budget_is_cut():
    from areal_core.algo import allocate_shared_prompt_microbatches

    groups = allocate_shared_prompt_microbatches([[1, 2]] * 4, [5, 5, 5, 5], 13)
    assert sorted(map(sorted, groups)) == [[0, 1], [2, 3]]  # 2 + 5 + 5 = 12 each
    with pytest.raises(ValueError, match="sequence 1 has length 14"):
        allocate_shared_prompt_microbatches([[1], [1, 2, 3, 4]], [3, 10], 13)


def test_shared_prompt_allocation_without_sharing_is_the_plain_one():
    from areal_core.algo import allocate_shared_prompt_microbatches

    rng = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 40, (50,), generator=rng).tolist()
    prompts = [[i, i] for i in range(50)]  # all different
    assert allocate_shared_prompt_microbatches(prompts, lens, 100) == allocate_microbatches([n + 2 for n in lens], 100)
