import random
import re

import pytest

from areal_core.data.config import SyntheticTask
from areal_core.data.synthetic import (
    ChainTask,
    chain_length_probs,
    check_chain,
    is_eval_prompt,
    make_prompt,
    parse_chain_answer,
    solve_chain,
)


def test_prompt_and_solution_format():
    assert make_prompt([3, 5, 7]) == "a3b5c7="
    assert solve_chain("a3b5c7=") == "a3=3,b5=8,c7=15|15"  # the default, explicit format
    assert solve_chain("a3b5c7=", "compact") == "a3b8c15|15"
    with pytest.raises(ValueError, match="unknown chain format"):
        solve_chain("a3b5c7=", "verbose")
    with pytest.raises(ValueError):
        solve_chain("a3b5c7")


def test_chain_length_frequencies_follow_power_law():
    cfg = SyntheticTask(min_chain=2, max_chain=12, alpha=1.0)
    task = ChainTask(cfg)
    n = 20_000
    draws = task.sample_lengths(n, random.Random(123))
    probs = chain_length_probs(2, 12, 1.0)
    assert abs(sum(probs.values()) - 1) < 1e-12
    assert probs[2] / probs[4] == pytest.approx(2.0)
    chi2 = sum((draws.count(k) - n * p) ** 2 / (n * p) for k, p in probs.items())
    # 10 degrees of freedom: P(chi2 > 29.6) ~ 0.001
    assert chi2 < 29.6, chi2


def test_alpha_zero_is_uniform():
    probs = chain_length_probs(3, 6, 0.0)
    assert set(probs.values()) == {0.25}


def _split(seed=0, n_train=3000, n_eval=300):
    task = ChainTask(SyntheticTask(n_train=n_train, n_eval=n_eval, seed=seed))
    return task.train_records(), task.eval_records()


def test_eval_split_disjoint_and_deterministic():
    train, held_out = _split()
    assert len(held_out) >= 200
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    assert all(is_eval_prompt(r.prompt, 0) for r in held_out)
    train2, held_out2 = _split()
    assert [r.model_dump() for r in held_out] == [r.model_dump() for r in held_out2]
    assert [r.model_dump() for r in train] == [r.model_dump() for r in train2]
    # the split does not depend on the split sizes
    _, bigger = _split(n_eval=400)
    assert [r.prompt for r in bigger[:300]] == [r.prompt for r in held_out]
    # another seed, another data set
    _, other = _split(seed=1)
    assert [r.prompt for r in other] != [r.prompt for r in held_out]
    assert len({r.id for r in train} | {r.id for r in held_out}) == len(train) + len(held_out)


def test_records_schema():
    train, _ = _split(n_train=50, n_eval=10)
    for r in train:
        assert r.task == "chain"
        assert r.answer == str(sum(int(c) for c in r.prompt[1::2] if c.isdigit()))
        assert 2 <= r.meta["k"] <= 12
        assert len(r.prompt) == 2 * r.meta["k"] + 1


@pytest.mark.parametrize(
    "response,answer,ok",
    [
        ("a3b8c15|15", "15", True),
        ("a3b8c15| 15 ", "15", True),  # extra spaces
        ("a3b8c15|15\n", "15", True),
        ("a3b8c15|16", "15", False),  # wrong total
        ("a3b8c15 15", "15", False),  # missing "|"
        ("15", "15", False),
        ("a3b8c15|15abc", "15", False),  # trailing junk
        ("a3b8c15|15|", "15", False),  # nothing after the last "|"
        ("a1|99|15", "15", True),  # the last "|" counts
        ("a3b8c15|15|99", "15", False),
        ("", "15", False),
        ("|", "15", False),
        ("a3|x", "15", False),
        ("|15", "15", True),
        ("|015", "15", True),
        ("|15", "fifteen", False),
    ],
)
def test_check_chain_cases(response, answer, ok):
    assert check_chain(response, answer) is ok


def test_parse_chain_answer():
    assert parse_chain_answer("a3b8c15|15") == "15"
    assert parse_chain_answer("a3b8c15") is None
    assert parse_chain_answer("a3|1 5") is None


def test_every_compact_solution_passes_and_running_totals_are_right():
    task = ChainTask(SyntheticTask(n_train=2000, n_eval=300, format="compact"))
    for r in task.train_records() + task.eval_records():
        assert check_chain(r.solution, r.answer)
        digits = [int(d) for d in re.findall(r"[a-z](\d)", r.prompt)]
        labels = re.findall(r"([a-z])\d", r.prompt)
        body, final = r.solution.split("|")
        steps = re.findall(r"([a-z])(\d+)", body)
        assert [lab for lab, _ in steps] == labels
        running = 0
        for d, (_, shown) in zip(digits, steps):
            running += d
            assert int(shown) == running
        assert int(final) == sum(digits) == int(r.answer)
        assert "".join(f"{lab}{v}" for lab, v in steps) == body


def test_grade_chain_is_strict_about_the_chain():
    from areal_core.data.synthetic import grade_chain

    sol = "a3b8c15|15"
    assert grade_chain("a3b8c15|15", sol) == (True, "15", "ok")
    assert grade_chain(" a3b8c15|15 ", sol)[0]
    assert grade_chain("a3b9c15|15", sol) == (False, "15", "wrong chain")  # right number, wrong chain
    assert grade_chain("a3b8c15|16", sol) == (False, "16", "wrong final answer")
    assert grade_chain("a3b8c15", sol) == (False, None, "no answer found")
    assert grade_chain("", sol) == (False, None, "no answer found")


def test_every_explicit_solution_writes_each_digit_and_running_total():
    train, held_out = _split(n_train=2000, n_eval=300)
    for r in train + held_out:
        assert check_chain(r.solution, r.answer)
        prompt_steps = re.findall(r"([a-z])(\d)", r.prompt)
        body, final = r.solution.split("|")
        steps = [re.fullmatch(r"([a-z])(\d)=(\d+)", part).groups() for part in body.split(",")]
        assert [(lab, d) for lab, d, _ in steps] == prompt_steps
        running = 0
        for _, d, shown in steps:
            running += int(d)
            assert int(shown) == running
        assert int(final) == running == int(r.answer)
